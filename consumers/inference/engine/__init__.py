"""The built-in batch engine: a stepping engine over a transformers model.

`batch.py` (BatchEngine: the queue, the running batch and the sampler stepped together),
`scheduler.py` (what waits, what is cancelled, who joins the batch), `running.py` (the
rows and their forward passes, poison isolation), `sequences.py` (each row's next token,
text and end), `kvcache.py` (the KV slab), `prefix.py` (the prefix cache), `packed.py` and
`lean.py` (the packed and lean forward passes), `prepack.py` and `quantize.py` (linear
layers prepared for decoding), `sampling.py` (sampling parameters, token selection,
detokenizing), `logprobs.py`."""
