"""Constrained decoding: per-request grammars (xgrammar) turned into a token bitmask each step.

params.py            StructuredOutputsParams / GuidedDecodingParams (what a request asks for)
backend_types.py     the backend interface: compile a grammar, advance it, fill its bitmask rows
backend_xgrammar.py  the xgrammar backend (JSON schema checks, error messages)
request.py           one request's grammar: compiled off the engine loop, advanced by accepted tokens
manager.py           the engine core's side: compile pool, per-step bitmask (GrammarOutput)
gated_manager.py     its gated-sampling half: a step's gate, the job whose filler opens it
backend_select.py    which backend the engine builds (grammar workers or the bitmask thread), threads
conflicts.py         a grammar and allowed_token_ids / bad_words / min_tokens leaving nothing: a 400
sample_check.py      the same met while running: a sampled token its bitmask forbids ends the request
productive.py        grammars deriving no finite string, regexes matching nothing: a 400
fill_thread.py       the bitmask thread: a step's fill beside the step loop, handed over by raw locks
backend_process.py   the grammar worker's engine side: grammars as slots, one message a step, shared bitmasks
worker_lanes.py      its per-worker lanes: a grammar as a slot, one lane per worker process, the step job
grammar_worker.py    the grammar worker process: the matchers, accept + fill beside the step loop
bitmask.py           the one place the bitmask meets the logits (device side)
"""
