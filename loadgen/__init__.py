"""Agentic load generator: trace formats, synthesis from published workload tables, closed-loop replay
against any OpenAI-compatible server, metrics, result JSON, comparisons and plots (see README.md here).

Pure cores: `trace`, `formats`, `content`, `synth`, `profiles`, `stats`, `sessions`, `plan`, `metrics`,
`report`, `sse` (the event stream parser). Async shell: `client` (HTTP/SSE, also used by the benchmarks),
`replay` (the engine), `runner` (signals, files). CLI: `cli`. Benchmarks (`kvpath bench ...`): `bench/`.
"""
