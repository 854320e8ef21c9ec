"""Device memory: what the KV pool may take on a device (`engine.memory.budget`)."""
