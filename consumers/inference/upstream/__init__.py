"""The upstream backend: a model with `backend: upstream` in the models config is served
by an OpenAI-compatible server arenaflow does not run (vLLM, SGLang, TGI, llama-server,
Ollama, a hosted API), streamed by the inference worker behind the same runner interface
as the built-in engine (admission, deadlines, chunks, cancellation and the event log
unchanged). `options` is the config's `upstream:` block; `engine` drives it."""
