"""tidegate inside vLLM: any tidegate controller at every step of vLLM's own engine.

``--scheduler-cls tidegate.engine.vllm.scheduler.TidegateScheduler`` (``TidegateAsyncScheduler``
where vLLM schedules asynchronously, as its CUDA build does by default) runs the controller named
in ``--additional-config '{"tidegate": {"controller": "slo-flow"}}'`` (or ``TIDEGATE_CONTROLLER``)
inside vLLM's scheduler: its Observation is fed from vLLM's queues, KV blocks and steps, and its
Decision sets how many waiting requests join the running batch this step, the step's token
budget and the running cap. vLLM's chunked prefill, prefix caching and preemption by recompute
stay as they are. ``--middleware tidegate.engine.vllm.middleware.AdmissionMiddleware`` answers 429 in
vLLM's API process, from the Observation the engine publishes after every step, and puts tidegate's
counters on vLLM's ``/metrics``; ``tidegate serve --engine vllm`` adds both flags.

This is the only subpackage of tidegate that imports vLLM (only ``scheduler`` does: the others load
without it); the rest of tidegate never needs it.

    scheduler.py  the Scheduler subclasses: observe, decide, apply, log
    observer.py   vLLM's state and steps into tidegate's ObservationStats
    decider.py    the controller's Decision, checked, in time, or a conservative one
    config.py     the plugin's settings (additional config or environment) and the controller
    channel.py    the records the engine and API processes share (seqlocked mmap files)
    admission.py  arrivals decided in the API process by a twin of the engine's controller
    middleware.py the ASGI middleware: request bodies, prompt tokens, the 429
    metrics.py    the ``tidegate:`` metrics on vLLM's /metrics
    step_log.py   one CSV row per step, in the columns ``tidegate profile --from-steps`` reads
    version.py    the vLLM versions the plugin supports
"""
