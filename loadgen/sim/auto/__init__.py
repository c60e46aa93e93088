"""`--policy auto` in the simulator: every KV path on one cluster, the fixed policies as baselines.

workloads.py  the five workloads of `kvpath bench auto` as sessions
cluster.py    the simulated cluster (engines, links, storage NICs, the pool; tiers) and a plan's execution
policies.py   the fixed policies as rules over the same enumerated plans, and `auto`
run.py        the event loop, scores and the comparison
"""
