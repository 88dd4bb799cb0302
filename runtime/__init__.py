"""What every arenaflow process imports at run time: settings, the NATS/JetStream connection, Redis, logs.

Imports only `events` (the contract); never the consumers, the gateway or `infra` (the operator tools)."""
