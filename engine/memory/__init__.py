"""Device memory: what the KV pool may take on a device (`engine.memory.budget`), and
CPU tensors on 2 MiB pages for what a step streams (`engine.memory.pages`)."""
