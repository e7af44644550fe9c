"""The fleet front: one OpenAI-compatible endpoint before many replicas of any engine.

``replicas``: what the gateway knows of each replica (its gauges, scraped from ``/metrics``, their
age, the requests it has in flight there, whether it is up). ``queue``: the gateway queue, its
admission (429 with a Retry-After from the fleet's drain rate), priorities, token-fair tenants and
TTL. ``routers``: which replica with room takes the queue's next request. ``app``: the HTTP front,
which proxies streams and handles the faults of replicas and clients.
"""
