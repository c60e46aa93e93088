"""`kvpath up`: a local cluster from one command (`launcher`), what it starts (`topology`, pure), and
`process` (`kvpath up` in a subprocess, for tests and benchmarks)."""
