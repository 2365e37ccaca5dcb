"""Every way an option can be wrong gives an error that names the key, what was given and what is allowed."""

import pytest
import torch

import kpt_compiler
from kpt_compiler import OptionError, parse_options
from kpt_compiler.registry import GraphPass, register_pass, unregister_pass

from models import make


def test_defaults():
    opts = parse_options(None, None)
    assert opts.mode == "default" and opts.device == "auto" and opts.codegen == "auto"
    assert opts.dump_dir is None and opts.strict is False
    # test passes are registered off by default, so none is enabled
    assert not opts.pass_enabled("test-relu-to-clamp")


def test_unknown_key_suggests_the_closest_and_lists_valid():
    with pytest.raises(OptionError) as e:
        parse_options(None, {"dump_dri": "x"})
    msg = str(e.value)
    assert "'dump_dri'" in msg and "did you mean 'dump_dir'" in msg
    for valid in ("device", "codegen", "strict", "mode", "test_relu_to_clamp"):
        assert valid in msg


def test_inductor_key_at_top_level_points_to_the_inductor_dict():
    with pytest.raises(OptionError, match=r"Inductor option.*options=\{'inductor': \{'max_autotune'"):
        parse_options(None, {"max_autotune": True})


@pytest.mark.parametrize(
    "options, pattern",
    [
        ({"strict": "yes"}, r"'strict' in options must be bool; got 'yes' \(str\)"),
        ({"device": "tpu"}, r"'device' in options must be 'auto' or 'cuda' or 'cpu' or 'xla'; got 'tpu'"),
        ({"codegen": "c++"}, r"'codegen' .* must be 'auto' or 'inductor' or 'eager'"),
        ({"mode": "fastest"}, r"'mode' .* must be 'default' or 'reduce-overhead'"),
        ({"dump_dir": 3}, r"'dump_dir' .* must be str or None; got 3"),
        ({"disable": "test-raise"}, r"'disable' .* must be a list of str"),
        ({"inductor": ["max_autotune"]}, r"'inductor' .* must be a dict"),
    ],
)
def test_wrong_type_or_value_names_key_given_and_allowed(options, pattern):
    with pytest.raises(OptionError, match=pattern):
        parse_options(None, options)


def test_pass_options_are_checked_like_top_level_ones():
    with pytest.raises(OptionError, match=r"unknown option 'factr' in options\['test_scale_outputs'\]; did you mean 'factor'"):
        parse_options(None, {"test_scale_outputs": {"factr": 3.0}})
    with pytest.raises(OptionError, match=r"'factor' in options\['test_scale_outputs'\] must be float; got 'big'"):
        parse_options(None, {"test_scale_outputs": {"factor": "big"}})
    # the pass's own __post_init__ check
    with pytest.raises(OptionError, match=r"options\['test_scale_outputs'\]: factor must not be 0"):
        parse_options(None, {"test_scale_outputs": {"factor": 0}})
    with pytest.raises(OptionError, match=r"'test_relu_to_clamp' must be True, False or a dict"):
        parse_options(None, {"test_relu_to_clamp": 1})


def test_pass_switches_and_options():
    opts = parse_options(None, {"test_scale_outputs": {"factor": 3}, "test-relu-to-clamp": True})
    assert opts.pass_enabled("test-scale-outputs") and opts.pass_options("test-scale-outputs").factor == 3.0
    assert opts.pass_enabled("test-relu-to-clamp") and opts.passes["test-relu-to-clamp"].explicit
    off = parse_options(None, {"disable": ["attention"]})
    assert not off.pass_enabled("attention") and parse_options(None, {}).pass_enabled("attention")


def test_disable_and_pipeline_name_passes_that_exist():
    with pytest.raises(OptionError, match=r"unknown option 'test-rais' in options\['disable'\].*did you mean 'test-raise'"):
        parse_options(None, {"disable": ["test-rais"]})
    with pytest.raises(OptionError, match=r"options\['pipeline'\] names pass 'test-raise' twice"):
        parse_options(None, {"pipeline": "test-raise,test-raise"})
    opts = parse_options(None, {"pipeline": "test-skip, test-raise"})
    assert opts.pipeline == ("test-skip", "test-raise")


def test_inductor_dict_is_checked_against_inductor_config():
    with pytest.raises(OptionError, match=r"unknown option 'max_autotun' in options\['inductor'\].*did you mean 'max_autotune'"):
        parse_options(None, {"inductor": {"max_autotun": True}})
    assert parse_options(None, {"inductor": {"max_autotune": True}}).inductor["max_autotune"] is True


def test_mode_from_torch_compile_and_from_options():
    assert parse_options("reduce-overhead", None).mode == "reduce-overhead"
    assert parse_options(None, {"mode": "max-autotune"}).mode == "max-autotune"
    with pytest.raises(OptionError, match="disagree"):
        parse_options("reduce-overhead", {"mode": "max-autotune"})


def test_round_trip_through_a_dict():
    opts = parse_options("max-autotune", {"test_scale_outputs": {"factor": 4}, "disable": ["test-raise"],
                                         "inductor": {"max_autotune": True}, "strict": True})
    again = parse_options(None, opts.to_dict())
    assert again == opts


def test_environment_variables(monkeypatch, tmp_path):
    monkeypatch.setenv("KPT_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("KPT_DISABLE", "test-relu-to-clamp")
    monkeypatch.setenv("KPT_STRICT", "1")
    opts = parse_options(None, {"test_relu_to_clamp": True})
    assert opts.dump_dir == str(tmp_path) and opts.strict
    assert not opts.pass_enabled("test-relu-to-clamp")
    # explicit options win over the environment
    assert parse_options(None, {"dump_dir": None, "strict": False}).dump_dir is None


def _compile_and_run(options, mode=None):
    model, x = make("mlp")
    compiled = torch.compile(model, backend="kernelpytorch", mode=mode, options=options)
    return compiled(x)


def test_errors_surface_through_torch_compile():
    with pytest.raises(Exception, match=r"did you mean 'codegen'"):
        _compile_and_run({"codegn": "eager"})


def test_modes_that_need_inductor_are_refused_with_eager_codegen():
    with pytest.raises(Exception, match=r"mode='reduce-overhead' needs Inductor.*codegen='eager'"):
        _compile_and_run({"codegen": "eager", "mode": "reduce-overhead"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_that_is_not_there():
    """Without CUDA the error says so (moving the inputs would not help); with it, that the inputs are elsewhere."""
    expected = "but the graph's inputs are on 'cpu'" if torch.cuda.is_available() else \
        "but torch sees no CUDA device here"
    with pytest.raises(OptionError, match=rf"options\['device'\]='cuda', {expected}"):
        _compile_and_run({"device": "cuda", "codegen": "eager"})


def test_asked_for_pass_the_device_cannot_run_is_an_error():
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine the pass can run")
    with pytest.raises(Exception, match=r"options\['test_cuda_only'\] was asked for, but it needs a CUDA GPU"):
        _compile_and_run({"codegen": "eager", "test_cuda_only": True})


def test_default_pass_the_device_cannot_run_steps_aside():
    spec = GraphPass(name="test-default-cuda", summary="on by default, CUDA only", stage="joint",
                     run=lambda gm, ctx: False, supports=lambda t, o: None if t.is_cuda else "it needs CUDA")
    register_pass(spec)
    try:
        _compile_and_run({"codegen": "eager"})
        rec = kpt_compiler.last_report().pass_record("test-default-cuda")
        assert rec.status == "skipped" and rec.reason == "it needs CUDA"
    finally:
        unregister_pass("test-default-cuda")


def test_backend_rejects_unexpected_keywords():
    from kpt_compiler.backend import kernelpytorch

    with pytest.raises(OptionError, match="takes mode= and options="):
        kernelpytorch(None, [], fullgraph=True)


def test_pass_declarations_are_checked():
    with pytest.raises(ValueError, match="kebab-case"):
        GraphPass(name="Bad_Name", summary="", stage="joint", run=lambda gm, ctx: False)
    with pytest.raises(ValueError, match="stage must be one of"):
        GraphPass(name="x", summary="", stage="late", run=lambda gm, ctx: False)
    with pytest.raises(ValueError, match="lossy, so it must be off by default"):
        GraphPass(name="x", summary="", stage="joint", run=lambda gm, ctx: False, lossy=True)


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), ("TRUE", True), (" yes ", True), ("On", True),
                                           ("0", False), ("false", False), ("No", False), ("off", False)])
def test_kpt_strict_takes_the_usual_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("KPT_STRICT", raw)
    assert parse_options(None, None).strict is expected
    assert parse_options(None, {"strict": not expected}).strict is (not expected)  # the options win


def test_kpt_strict_refuses_anything_else(monkeypatch):
    monkeypatch.setenv("KPT_STRICT", "sometimes")
    with pytest.raises(OptionError, match=r"KPT_STRICT='sometimes' must be one of 1/true/yes/on or 0/false/no/off"):
        parse_options(None, None)
    assert parse_options(None, {"strict": True}).strict  # where the options say, the variable is not read
    monkeypatch.setenv("KPT_STRICT", "")  # empty: as unset
    assert parse_options(None, None).strict is False


def test_pipeline_runs_exactly_the_passes_it_names():
    opts = parse_options(None, {"pipeline": ["test-relu-to-clamp"]})  # off by default
    assert opts.pass_enabled("test-relu-to-clamp")
    model, x = make("mlp")
    torch.compile(model, backend="kernelpytorch", options={"codegen": "eager", "pipeline": "test-relu-to-clamp"})(x)
    assert kpt_compiler.last_report().pass_record("test-relu-to-clamp").status == "applied"
    with pytest.raises(OptionError, match=r"options\['pipeline'\] names 'test-relu-to-clamp' and "
                                          r"options\['test_relu_to_clamp'\] switches it off"):
        parse_options(None, {"pipeline": ["test-relu-to-clamp"], "test_relu_to_clamp": False})
    with pytest.raises(OptionError, match=r"options\['pipeline'\] names 'fusion' and options\['fusion'\] is False"):
        parse_options(None, {"pipeline": ["fusion"], "fusion": False})
    with pytest.raises(OptionError, match=r"options\['fuse_gated_linear'\] asks for pass 'fuse-gated-linear', which "
                                          r"options\['pipeline'\] leaves out"):
        parse_options(None, {"pipeline": ["attention"], "fuse_gated_linear": {"decide": "always"}})
    # a member of a named group that the options switch off stays off
    opts = parse_options(None, {"pipeline": ["fusion"], "fusion": {"gated": False}})
    assert not opts.pass_enabled("fuse-gated-linear") and opts.pass_enabled("fuse-linear-epilogue")


@pytest.mark.parametrize("options, pattern", [
    ({"test_scale_outputs": {"factor": 3}, "disable": ["test-scale-outputs"]},
     r"options\['test_scale_outputs'\] asks for pass 'test-scale-outputs' and options\['disable'\] names"),
    ({"test_relu_to_clamp": True, "disable": ["test_relu_to_clamp"]}, r"options\['test_relu_to_clamp'\] asks for"),
    ({"fuse_gated_linear": {"decide": "always"}, "disable": ["fusion"]},
     r"options\['fuse_gated_linear'\] asks for pass 'fuse-gated-linear' and options\['disable'\] names 'fusion'"),
    ({"pipeline": ["test-skip"], "disable": ["test-skip"]},
     r"options\['pipeline'\] names 'test-skip' and options\['disable'\] names 'test-skip'"),
    ({"pipeline": ["fuse-gated-linear"], "disable": ["fusion"]},
     r"options\['pipeline'\] names 'fuse-gated-linear' and options\['disable'\] names 'fusion'"),
])
def test_contradictions_are_refused_naming_both_keys(options, pattern):
    with pytest.raises(OptionError, match=pattern):
        parse_options(None, options)


@pytest.mark.parametrize("options, off", [
    ({"fusion": {"decide": "always"}, "disable": ["fuse-gated-linear"]}, "fuse-gated-linear"),
    ({"fusion": True, "disable": ["fuse-add-norm"]}, "fuse-add-norm"),
    ({"pipeline": ["fusion"], "disable": ["merge-parallel-linears"]}, "merge-parallel-linears"),
])
def test_a_group_with_one_member_switched_off_is_no_contradiction(options, off):
    opts = parse_options(None, options)
    assert not opts.pass_enabled(off) and opts.pass_enabled("fuse-linear-epilogue")


@pytest.mark.parametrize("key", ["attention", "fusion", "fuse_gated_linear"])
def test_none_is_not_a_setting(key):
    with pytest.raises(OptionError, match=rf"option '{key}' must be True, False or a dict .*got None"):
        parse_options(None, {key: None})


def test_inductor_values_are_checked_against_the_config_type():
    with pytest.raises(OptionError, match=r"option 'max_autotune' in options\['inductor'\] must be bool \(the type "
                                          r"of torch._inductor.config.max_autotune\); got 'yes' \(str\)"):
        parse_options(None, {"inductor": {"max_autotune": "yes"}})
    with pytest.raises(OptionError, match=r"'cpp.threads' in options\['inductor'\] must be int"):
        parse_options(None, {"inductor": {"cpp.threads": 2.5}})
    assert parse_options(None, {"inductor": {"max_autotune": True, "cpp.threads": 2}}).inductor["cpp.threads"] == 2


def test_an_option_error_reaches_the_user_as_itself():
    """Dynamo wraps a backend's errors in BackendCompilerFailed; ours pass through as OptionError."""
    compiled = torch.compile(lambda x: x + 1, backend="kernelpytorch", options={"dump_dri": "x"})
    with pytest.raises(OptionError, match=r"^unknown option 'dump_dri' in options; did you mean 'dump_dir'"):
        compiled(torch.ones(2))
