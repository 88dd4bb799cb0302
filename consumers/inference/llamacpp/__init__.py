"""The llama.cpp backend: a model with `backend: llamacpp` in the models config is served by
a `llama-server` child of the inference worker, driven over its HTTP API, behind the same
runner interface as the built-in engine (admission, deadlines, chunks, cancellation and
redelivery unchanged). `build` makes the binary; `runner` drives it."""
