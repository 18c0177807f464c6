"""Serving edge: deployment configs, the `serve` command and the /v1/moe endpoint.

Nothing here is imported by the adapter core; vLLM is imported only where a server runs.
"""
