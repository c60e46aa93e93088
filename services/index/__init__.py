"""Metadata index: block hash -> locations, longest-prefix match, fed by KV events from JetStream."""
