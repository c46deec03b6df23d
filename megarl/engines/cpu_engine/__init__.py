"""megarl's CPU engine: the HF engine (:mod:`.hf_engine`) behind SGLang's HTTP API (:mod:`.server`), standing in
for ``sglang.launch_server`` where SGLang cannot run (CPU, CI). Production rollout code talks to it only over
HTTP, as to SGLang, and knows nothing of it.

    python -m megarl.engines.cpu_engine --model-path DIR --port 30000 [--host 127.0.0.1] [--dtype float32] ...

State, as SGLang's scheduler keeps it, at this engine's granularity (decoding steps):

- **Requests** are queued rows; a scheduler task runs them in batches on the engine thread
  (rows that differ only in seed and ``max_new_tokens`` share a batch; a batched ``/generate``
  arrives at once, so its rows form one batch). A batch takes no rows once started, so an idle
  engine starts one once no request has arrived for 10 ms (at most 100 ms after the first:
  ``server.ARRIVAL_QUIET_S``): requests sent together from several threads share it, as SGLang's
  continuous batching would run them together. Row ``i`` of a request samples from
  ``derive_row_seed(sampling_seed, i)`` (its own ``sampling_params``' seed, or the one shared by
  the batch: sglang-router forwards a batch with one ``sampling_params``), so a batch sharing
  one seed still gives every row its own stream; without a seed, rows draw from the server's
  seeded generator. (SGLang with deterministic inference would give every row of such a batch
  the same seed: megarl sends seeds only to this engine.)
- **Pause** (``/pause_generation``): ``abort`` ends running and queued rows now (finish reason
  ``abort``, tokens so far kept); ``in_place`` holds the running batch between two decoding
  steps, KV cache kept; ``retract`` holds it and, on ``/continue_generation``, recomputes its KV
  cache from the tokens so far with the weights then loaded. Until ``/continue_generation`` no
  new batch starts. The answer to ``/pause_generation`` comes once no forward pass runs.
- **Memory tags** (``/release_memory_occupation``, ``/resume_memory_occupation``; ``weights``,
  ``kv_cache``, ``cuda_graph``; none given: all). Generating needs ``weights`` and ``kv_cache``
  held, and updating weights needs ``weights`` held: this engine refuses both otherwise (on
  GPUs SGLang would compute garbage from released weights), so a wrong phase order fails in CI.
  Releasing while rows run (not paused) is refused. Released ``weights`` are **gone**, as SGLang's memory
  saver frees them: NaN until a weight update rewrites each tensor whole, and generating is refused while any
  is not; ``--enable-weights-cpu-backup`` (SGLang's flag) keeps them.
- **Weights** change inside a ``/begin_weight_update`` ... ``/end_weight_update`` session
  (``/update_weights_from_tensor``: SGLang's ``MultiprocessingSerializer`` payloads, one per
  engine TP rank, ``load_format`` ``flattened_bucket`` or a list of ``(name, tensor)``); each
  update may set ``weight_version``. An answer reports, as SGLang 0.5.23 does, ``weight_version``
  and ``weight_versions``: spans of its output tokens per version (a request held by an
  ``in_place``/``retract`` pause across an update has two). No batch starts inside a session, and
  ``/begin_weight_update`` waits for a running batch that is not paused, so every token was
  sampled by one set of weights. ``/flush_cache`` is refused (HTTP 400) while requests are held in
  place or run unpaused; retracted ones do not count (SGLang's ``flush_cache``).
- **TP ranks** (``--tp-size N``): the model is one unsharded copy, but the weight paths behave as
  N SGLang TP ranks do, each taking the full tensors: ``/update_weights_from_tensor`` needs N
  payloads and opens each once (each holds its own reference to the shared bucket), checking that
  they name the same tensors; ``/init_weights_update_group`` joins N members (ranks
  ``rank_offset .. rank_offset + N - 1``), each receiving every broadcast. The weights load from
  rank 0's copy.
- **Routed experts** (mixture-of-experts models, ``--enable-return-routed-experts`` as SGLang's flag):
  ``/generate`` with ``return_routed_experts`` answers ``meta_info.routed_experts``, SGLang's base64 of an int32
  ``[seqlen - 1 - routed_experts_start_len, num_hidden_layers, top_k]`` array: the experts each token the model
  computed was routed to (the last output token is never fed back; a retracted row's are those of the rebuilt
  pass). Without the flag the field is absent, as on SGLang.
- **Load** (``GET /v1/loads``, SGLang's route and shape): ``num_running_reqs`` (rows of the running batch),
  ``num_waiting_reqs`` (queued rows), ``num_used_tokens`` (the running rows' prompt and output tokens),
  ``queues.waiting`` / ``paused`` (rows held by an ``in_place``/``retract`` pause) / ``retracted``. Callers
  wait on these (a request has arrived, is running, is held) instead of on the clock.
- **Step gate** (``--enable-step-gate``, megarl only; tests use it to stop generation at a known token, on
  a machine of any speed): ``POST /step_gate {"hold_at": k}`` holds the running batch once its rows have ``k``
  output tokens, between two decoding steps, until ``{"hold_at": null}`` (or a larger ``k``) lets it go on;
  ``GET /step_gate`` answers ``hold_at``, ``held`` (the batch waits at the gate now) and ``tokens`` (the
  running rows' output tokens so far). A gate-held batch counts as running, not paused: weight updates and
  memory releases wait or refuse as for any running batch; a pause, abort or ``/abort_request`` acts on it as
  between any two steps. Without the flag the route does not exist.
- **LoRA** (``--enable-lora --max-lora-rank R --lora-target-modules ...``, SGLang's flags): adapters loaded from
  tensors (``/load_lora_adapter_from_tensors``, checksums checked on every TP rank's payload) or a PEFT directory
  (``/load_lora_adapter``), unloaded once their requests finish; ``/generate``'s ``lora_path`` names one per
  request or row, and requests of different adapters never share a batch (:mod:`.lora`).
- **Admin key** (the environment variable ``MEGARL_ENGINE_ADMIN_KEY``, as SGLang's ``--admin-api-key``, never on
  the command line): every control route (those SGLang marks ``ADMIN_OPTIONAL``: weight updates, memory,
  pause and continue, flush, weight reads, aborts; and ``/step_gate``) answers 401 to a request without
  ``Authorization: Bearer <key>``; generation, health, model info and loads stay open (the router uses them).
"""
