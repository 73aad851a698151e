"""The block printed before the first step says what will be trained, on what, and where it goes."""

from __future__ import annotations

from flowtrain.train.summary import _ranges
from flowtrain.train.run import TrainConfig, train


def test_the_summary_names_model_data_steps_and_outputs(tmp_path, capsys):
    train(TrainConfig(model="tiny", steps=2, batch_size=4, micro_batch_size=2, seq_len=32, device="cpu",
                      progress="lines", out=str(tmp_path / "out"), save_every=2, save_total_limit=3))
    lines = capsys.readouterr().out.splitlines()
    head = {line.split()[0]: line for line in lines[:7]}
    assert set(head) == {"model", "device", "memory", "activations", "data", "steps", "output"}
    assert "tiny: LlamaForCausalLM" in head["model"] and "random init" in head["model"]
    assert "fp32 compute" in head["device"]
    assert head["activations"].endswith("recompute from a checkpoint every layer")  # the CPU's activations
    assert "sequences of 32 tokens" in head["data"] and "2 steps cover" in head["data"]
    assert "2 of 4 sequences (128 tokens, 2 micro-batches of 2, layer order)" in head["steps"]  # auto on the CPU
    assert f"checkpoints every 2 steps to {tmp_path / 'out'}/checkpoint-STEP (keep 3)" in head["output"]
    assert lines[7].startswith("step 1/2")


def test_resident_units_are_listed_as_ranges():
    assert _ranges(("embed", "head", "layer.0", "layer.1", "layer.2", "layer.5")) == "embed, head, layer.0-2, layer.5"
    assert _ranges(()) == "none"


def test_the_activation_line_names_each_choice_by_layer_ranges():
    from flowtrain.graph import StepSpec
    from flowtrain.train.summary import describe_activations

    spec = StepSpec(layers=32, keep=(30, 31), save_attention=tuple(range(11, 30)), offload=(0, 1, 2, 5))
    assert describe_activations(spec) == ("layers 30-31 keep theirs; layers 11-29 save their attention output; "
                                          "checkpoints of layers 0-2, 5 offloaded; recompute from a checkpoint every layer")
    assert describe_activations(StepSpec(layers=4, keep=(0, 1, 2, 3))) == "layers 0-3 keep theirs"
    assert describe_activations(StepSpec(layers=4, checkpoint_every=2)) == "recompute from a checkpoint every 2 layers"
