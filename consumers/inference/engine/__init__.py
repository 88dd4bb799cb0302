"""The built-in batch engine: a stepping engine over a transformers model.

`batch.py` (the scheduler: admission, stepping, poison isolation), `kvcache.py` (the KV
slab), `prefix.py` (the prefix cache), `packed.py` and `lean.py` (the packed and lean
forward passes), `prepack.py` and `quantize.py` (linear layers prepared for decoding),
`sampling.py` (sampling parameters, token selection, detokenizing), `logprobs.py`."""
