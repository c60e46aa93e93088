"""The remote-memory KV store: the RDMA-pool baseline Beluga is measured against (Mooncake store's role)."""
