"""Beluga-style CXL memory pool pieces shared by the pool service and its clients.

The CXL-RPC transport lives in `shared.cxl.rpc` (shared memory, this host) and `shared.cxl.nats_rpc`
(the same calls over NATS); import them from there, so that importing one pool module does not load the rest.
"""
