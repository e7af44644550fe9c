"""Vanilla vLLM against vLLM with tidegate's plugin, same model and same client, measured from outside.

``benchmarks/vllm_overload.py`` is the command line; the pieces live here, one concept per module:

- ``model``: the model folder both servers load (a Llama built from a config, random weights, byte tokenizer)
- ``arms``: the arms compared (``name='vLLM server args'``) and the default set
- ``server``: vLLM's OpenAI server from ``.venv-vllm`` as a subprocess, its ``/metrics``
- ``clients``: streaming completions with token-id prompts, timing the first token and reading Retry-After
- ``phases``: the capacity run and one load of Poisson arrivals against a started server
- ``stats``: the figures of one arm at one load (goodput, latencies, outcomes) and the ratios between arms
- ``steps``: the plugin's step log, read for its own time per step
- ``report``: ``vllm_overload.json``, ``vllm_overload.md`` and ``vllm_overload.png``
- ``reuse``: an earlier run's rows and capacity, taken into a run of fewer arms (``--reuse``)

Nothing here imports vLLM: the servers run in vLLM's own venv, and the client talks HTTP to them.
"""
