"""raysweep's use of lm-eval, in one package: requests in, scores out (docs/lm-eval.md).

- `requests`: a spec's `lm_eval:` entries made into raysweep tasks, lm-eval building the requests;
- `scores`: lm-eval's own scoring of the committed answers, called by the run once a model's rows are in;
- `run`: the one `simple_evaluate` call both use, and the rule that makes requests into rows;
- `adapter`: every replacement of lm-eval internals, for the one release raysweep is written against;
- `quiet`: lm-eval's bars, log lines and prints kept out of a sweep's terminal.
What the actors read of an entry is in cluster/contracts/lm_eval_task.py (no lm-eval import there). The
`raysweep lm-eval` command (lm-eval's own command line with raysweep as its model) is jobs/lm_eval_model.py.
"""
