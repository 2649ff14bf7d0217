"""tierstore: a tiered KV-cache store for hybrid LLMs."""
