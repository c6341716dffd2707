"""Benchmarks and probes: what raysweep costs and gains, measured against the plain ways to do the same work.

    python -m benchmarks --parts a,b,c,d --model builtin:large   # parts a-e, x, y, p, o (benchmarks/__main__.py)
    python -m benchmarks.loglik --out DIR                        # part l: log-likelihood multiple choice
    python -m benchmarks.pool --out DIR                          # part w: sweeps on a warm engine pool
    python -m benchmarks.repro --out DIR                         # part r: do outputs repeat?
    python -m benchmarks.repro_probe --configs JSON              # which vLLM settings are batch-invariant
    python -m benchmarks.lm_eval_tasks --out DIR                 # part t: lm-eval tasks against lm_eval --model vllm

Modules: common (prompts, the Bench that records figures, child processes), engine_ratios (a-d),
whole_process (e), breakdown (x, y), orchestration (p, o), loglik (l), pool (w), repro (r), repro_probe,
lm_eval_tasks (t);
and the alternatives timed against raysweep, each run as its own process: plain_vllm, plain_vllm_loglik,
ray_data_llm.
"""
