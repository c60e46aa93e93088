"""Every scheduling decision of kvpath, as pure code over snapshots (no I/O, no clock, no asyncio, no torch).

The router, the engines and the simulator in `loadgen/sim` import these modules and nothing else decides:
  snapshot.py    what a decision reads (engine, node, request snapshots) and returns (placements)
  thresholds.py  DualPath's alpha / beta in tokens from measured rates
  placement.py   which engine(s) serve a request: colocated least-loaded; DualPath PE, DE and read side
  round.py       one placement round over a FIFO (the live dispatcher and the simulator call it)
  batching.py    a prefill engine's batch under the compute quota, and its attention-time profile
  quota.py       the quota planner that learns that profile, and the prefill rate behind beta
"""
