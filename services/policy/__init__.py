"""Every scheduling decision of kvpath, as pure code over snapshots (no I/O, no clock, no asyncio, no torch).

The router, the engines and the simulator in `loadgen/sim` import these modules and nothing else decides:
  snapshot.py    what a decision reads (engine, node, request snapshots) and returns (placements)
  thresholds.py  DualPath's alpha / beta in tokens from measured rates
  colocated.py   which colocated engine serves a request (least-loaded, beluga, cache-aware)
  load_table.py  the engines' and nodes' loads as flat lists, updated in place between rounds
  table_placement.py  DualPath's PE, DE and read side per request over a LoadTable (the rules as written,
                 one engine object at a time, are tests/reference_placement.py, the oracle it is tested on)
  round.py       one placement round over a FIFO (the live dispatcher and the simulator call it)
  batching.py    a prefill engine's batch under the compute quota, and its attention-time profile
  quota.py       the quota planner that learns that profile, and the prefill rate behind beta
"""
