"""The ledger of every run-time hook into upstream vLLM, each with a drift guard."""
