"""The scheduler's outputs cross a process boundary pickled (`ReqOutput.__reduce__` writes the
positional field values): every field survives, in order, and a new field cannot be forgotten."""

import dataclasses
import pickle

from kiln.engine.io import BatchOutput, ReqOutput, SpecCounts


def test_req_output_round_trips_every_field():
    # a distinct non-default value in every field, so a swapped or missing field shows
    values = dict(rid="r-0", new_token_ids=[5, 6], finished=True, finish_reason="stop", matched_stop=7,
                  prompt_tokens=11, cached_tokens=3, cached_tokens_details={"device": 3}, completion_tokens=2,
                  new_logprobs=[(-0.5, [(5, -0.5)])], prompt_logprobs=[None, (-1.0, [])], error="bad",
                  routed_experts=[[1, 2]], spec=SpecCounts())
    assert set(values) == {f.name for f in dataclasses.fields(ReqOutput)}, "a field was added: extend __reduce__"
    out = ReqOutput(**values)
    _, args = out.__reduce__()
    assert list(args) == [getattr(out, f.name) for f in dataclasses.fields(ReqOutput)]
    for proto in (2, pickle.DEFAULT_PROTOCOL, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(BatchOutput([out, ReqOutput("r-1", [])]), protocol=proto))
        assert back.outputs[0] == out and back.outputs[1] == ReqOutput("r-1", [])
