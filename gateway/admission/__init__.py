"""Admission: whether a request is let on, with one owner (`service.Admission`).

- `estimate`: the pure estimate (would a request finish before its deadline?) and its 429s;
- `queues`: a model's queue from the inference workers' typed heartbeats (pure);
- `recent`: the fleet-wide check, every gateway's recent admissions in Redis;
- `gate`: the early gate, judging a burst from what this process knows, peers included;
- `edge`: the gate at the HTTP edge (the protocol's hook and the middleware);
- `uvicorn_adapter`: the uvicorn protocols the hook runs in, and the uvicorn-private
  state they touch, in one place;
- `service`: `Admission`, which hands each request a `Lease` (`published()` /
  `refused()`), used alike by the protocol hook, the routes and the serving layer.

Nothing is imported here: `gateway.pipeline` reads `estimate`'s types, and `service`
reads the pipeline.
"""
