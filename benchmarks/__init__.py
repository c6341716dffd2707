"""Benchmarks and probes: what raysweep costs and gains, measured against the plain ways to do the same work.

    python -m benchmarks --parts a,b,c,d --model builtin:large   # parts a-e, x, y, p, o (benchmarks/__main__.py)
    python -m benchmarks.loglik --out DIR                        # part l: log-likelihood multiple choice
    python -m benchmarks.pool --out DIR                          # part w: sweeps on a warm engine pool
    python -m benchmarks.repro --out DIR                         # part r: do outputs repeat?
    python -m benchmarks.repro_probe --configs JSON              # which vLLM settings are batch-invariant
    python -m benchmarks.lm_eval_tasks --out DIR                 # part t: lm-eval tasks against lm_eval --model vllm
    python -m benchmarks.scale_out --gpus N --out DIR            # part n: one sweep on N GPUs against the plain ways
    python -m benchmarks.suite_8b --out DIR --fraction F         # part s: lm-eval's suite at 8B size
    python -m benchmarks.weights_probe default|preloaded DIR     # a checkpoint read while vLLM imports, or not

Modules: common (prompts, the Bench that records figures, child processes), engine_ratios (a-d),
whole_process (e), breakdown (x, y), orchestration (p, o), loglik (l), pool (w), repro (r), repro_probe,
lm_eval_tasks (t), scale_out (n), suite_8b, suite_tasks and suite_agreement (s), weight_files, weights_probe;
and the alternatives timed against raysweep, each run as its own process: plain_vllm, plain_vllm_loglik,
ray_data_llm.
"""
