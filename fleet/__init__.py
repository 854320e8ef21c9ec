"""A day of a real service on a simulated clock: a trace of requests, replicas running
continuous batching over a paged KV pool, a router in front of them and an autoscaler,
their step times from measured step costs (`fleet.costs`)."""
