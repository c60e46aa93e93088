"""Agentic load generator: trace formats, synthesis from published workload tables, closed-loop replay
against any OpenAI-compatible server, metrics, result JSON, comparisons and plots (see README.md here).

Pure cores: `trace`, `formats`, `content`, `synth`, `profiles`, `stats`, `sessions`, `plan`, `metrics`,
`report`. Async shell: `client` (HTTP/SSE), `replay` (the engine), `runner` (signals, files). CLI: `cli`.
"""
