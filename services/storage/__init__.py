"""Storage service, one per node: Full Blocks as files <-> the node's shared-memory DRAM buffer."""
