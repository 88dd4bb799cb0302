"""The inference worker's asyncio side: pulled messages in, engine outputs cut into
chunks and published, terminal events, acks, the watchdog."""
