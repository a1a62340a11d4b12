"""The relay gateway (PACT §9): durable queue (`store`), its MCP app (`app`), TLS (`server`)."""
