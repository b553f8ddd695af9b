"""Every place these scripts work around pyvene 0.1.8, pyreft 0.1.0 or bitsandbytes 0.50 (the pinned versions), or
torch 2.11 (what GPU images ship; alpaca.versions), in one module.

An upgrade of either re-checks each function below against the upstream behaviour its docstring names;
tests/test_interventions.py, tests/test_fsdp.py and tests/test_families.py fail where one is no longer needed or
no longer enough.
Also worked around elsewhere, for a reason local to that code: `alpaca.output.load_reft_model` (pyreft's
`ReftModel.load`: NoReFT's bias, bf16 learned sources, arbitrary imports) and `alpaca.zero.ReftModule`
(pyvene's `named_parameters` lists the interventions only).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import warnings

import torch
from torch.nn.attention import varlen
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from alpaca.constants import COMPONENTS, VARLEN_ATTENTION
from alpaca.layers import decoder_layer_list

# pyvene prints, as it is imported, that nnsight (an optional backend these scripts do not use) is not detected:
# pyreft and pyvene are imported here, quietly, and the other modules take them from here.
with contextlib.redirect_stdout(io.StringIO()):
    import pyreft  # noqa: F401 - for alpaca.model and alpaca.output
    import pyvene
    from pyvene.models.constants import CONST_OUTPUT_HOOK

# pyvene's hooks copy index tensors with torch.tensor(tensor), which warns that clone() is the recommended
# copy; the copy is what we want.
warnings.filterwarnings("ignore", message="To copy construct from a tensor", category=UserWarning, module="pyvene")

# torch 2.11's varlen_attn takes no `enable_gqa` (a TypeError at the first step of a grouped-query model); 2.12's does.
VARLEN_TAKES_GROUPED_HEADS = "enable_gqa" in inspect.signature(varlen.varlen_attn).parameters


def keep_foreign_hooks(reft_model) -> None:
    """Keep other code's forward hooks on the model. pyvene's cleanup, run at every forward, deletes *every* forward
    (pre-)hook on the model, not only its own: FSDP2's unshard/reshard hooks vanish and the next forward meets sharded
    DTensor weights. Make it delete pyvene's hooks only."""

    def remove_pyvene_hooks() -> None:
        for module in reft_model.model.modules():
            for hooks in (module._forward_hooks, module._forward_pre_hooks):
                for hook_id, hook in list(hooks.items()):
                    if getattr(hook, "__module__", "").startswith("pyvene"):
                        del hooks[hook_id]
                        module._forward_hooks_with_kwargs.pop(hook_id, None)
                        module._forward_pre_hooks_with_kwargs.pop(hook_id, None)

    reft_model._remove_forward_hooks = remove_pyvene_hooks


def scatter_on_device(reft_model) -> None:
    """Write intervened positions back on the activation's device. pyvene writes intervened positions back
    (modeling_utils.scatter_neurons) through a batch index it builds on the CPU: on CUDA that index is a blocking
    host-to-device copy in every hook, forward and backward. Make the same write with the index on the activation's
    device, for each of COMPONENTS (a hidden_size-wide output, as a tensor or the first of a tuple)."""
    pyvene_scatter = reft_model._scatter_intervention_output

    def scatter(output, intervened, key, unit_locations):
        representation = reft_model.representations[key]
        if (unit_locations is None or reft_model.use_fast or isinstance(output, dict) or representation.unit != "pos"
                or representation.component not in COMPONENTS):
            return pyvene_scatter(output, intervened, key, unit_locations)
        hidden = output[0] if isinstance(output, tuple) else output
        batch_index = torch.arange(hidden.shape[0], device=hidden.device).unsqueeze(1)
        hidden[batch_index, torch.as_tensor(unit_locations, device=hidden.device)] = intervened
        return hidden

    reft_model._scatter_intervention_output = scatter


def index_tensors_on(reft_model, device: torch.device | None) -> None:
    """Choose where pyvene's index tensors are built: pyvene builds them on `get_device()`, the base model's device: the
    CPU for a base whose shards FSDP offloads there, while the activations are on the GPU; the first parameter's (meta,
    when on disk) for a base spread by a device map. Build them where the activations are: on `device`, or with None on
    each hook's activation's own device (pyvene's fallback)."""
    reft_model.get_device = lambda: device


def trainable_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """Return the interventions' dtype: float32 on a bf16 or fp16 base (an AdamW update survives), the base's own where
    it is wider (float64)."""
    return torch.promote_types(base_dtype, torch.float32)


def compute_in_float32(reft_model) -> None:
    """Make the interventions compute in float32. pyreft 0.1.0 builds each intervention's learned source (and NoReFT's
    projection) in the dtype it is given, bfloat16 by default, and its forwards need the hidden state in that dtype
    (`learned_source(base)`). A bf16 weight loses AdamW's updates that fall below half a bf16 spacing: at lr 2e-5 most
    of its entries never move (docs/exactness.md). So interventions are built in float32
    (alpaca.model.new_intervention) and computed in float32: the hidden state goes in cast up, the output comes
    back in the base's dtype, which pyvene writes into the base's hidden state. On a float32 base both casts
    return their input (on a float64 one, everything is float64: `trainable_dtype`)."""
    dtype = reft_model.model.dtype
    compute_dtype = trainable_dtype(dtype)
    for intervention in {id(module): module for module in reft_model.interventions.values()}.values():
        intervention.register_forward_pre_hook(lambda module, args: (args[0].to(compute_dtype), *args[1:]))
        intervention.register_forward_hook(lambda module, args, output: output.to(dtype))


def set_train_mode(reft_model, training: bool) -> None:
    """Switch the interventions to `training` mode, the base to eval: pyvene's `train()`/`eval()` switch only the base
    model and leave the interventions (and their dropout) in whatever mode they were built: the frozen base stays in
    eval, interventions follow."""
    reft_model.model.eval()
    reft_model.interventions.train(training)


# The name of `causal_attention_without_mask_checks`'s attention function in transformers' AttentionInterface.
MASKLESS_SDPA = "sdpa_causal_no_mask"


def causal_attention_without_mask_checks(model) -> None:
    """Skip transformers' attention-mask checks in maskless forwards. transformers (5.x) prepares the attention mask in
    every forward; given no mask and no cache, as in our training and evaluation steps, it looks for packed sequences in
    the position ids (`find_packed_sequence_indices`), whose `.all()` blocks the host in each forward. An attention
    function under a name of our own, with no mask function registered, makes `create_causal_mask` return None at once:
    the layers get no mask, and the function is transformers' own SDPA one, which then runs plain causal attention (the
    same logits, tested). So only a forward with neither a mask, position ids nor a cache uses it (a pre-hook chooses
    per forward); any other (generation, a masked baseline) goes through "sdpa" and its masks, and a pack (--packing)
    through "sdpa" or, set up with --attn_implementation sdpa_varlen, `varlen_attention`. Only for a model on either."""
    config = model.config
    packs = config._attn_implementation
    if packs not in ("sdpa", VARLEN_ATTENTION):
        return
    AttentionInterface.register(MASKLESS_SDPA, sdpa_attention_forward)

    def choose_attention(module, args, kwargs) -> None:
        if config._attn_implementation not in ("sdpa", MASKLESS_SDPA, VARLEN_ATTENTION):
            return  # another implementation was set since (set_attn_implementation)
        # position_ids: a pack, whose examples only the mask built from them (or varlen's boundaries) keep apart
        maskless = (not args and kwargs.get("attention_mask") is None and kwargs.get("position_ids") is None
                    and kwargs.get("past_key_values") is None and kwargs.get("use_cache") is False)
        implementation = (MASKLESS_SDPA if maskless else packs if kwargs.get("cu_seq_lens_q") is not None
                          else "sdpa")
        if config._attn_implementation != implementation:
            config._attn_implementation = implementation

    model.register_forward_pre_hook(choose_attention, with_kwargs=True)


def varlen_attention(module, query, key, value, attention_mask, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """Compute a pack's attention (Collator.pack: one row, `cu_seq_lens_*` its examples' boundaries) through torch's
    varlen flash kernel, each example causal within itself: no pack x pack mask, no attention computed across
    examples, where SDPA given a pack's position ids builds a dense block-diagonal mask and computes the whole
    square. transformers has no attention function over torch's kernel (only over the flash-attn package's), so
    this is one, registered under VARLEN_ATTENTION with no mask function: transformers builds no mask for it.
    `query` is [1, heads, tokens, head_dim], key and value with the model's key-value heads; returns
    [1, tokens, heads, head_dim], as transformers' SDPA function does. No sliding window (refused at setup)."""
    query, key, value = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    grouped = {}
    if query.shape[1] != key.shape[1]:
        if VARLEN_TAKES_GROUPED_HEADS:
            grouped = {"enable_gqa": True}
        else:  # each query head's key-value head repeated, as transformers' repeat_kv does for eager attention
            key, value = (t.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for t in (key, value))
    output = varlen.varlen_attn(query, key, value, kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"],
                                kwargs["max_length_q"], kwargs["max_length_k"], scale=scaling, window_size=(-1, 0),
                                **grouped)
    return output.unsqueeze(0), None


def register_layout(model) -> None:
    """Register the model's layout with pyvene. pyvene finds the module of a component ('block_output') in
    `pyvene.type_to_module_mapping[type(model)]`, a table of nine decoder-only families (GPT-2, GPT-Neo, GPT-NeoX,
    Gemma, Gemma 2, Llama, Mistral, OLMo, Qwen2); for any other class it hooks an empty attribute name (`AttributeError:
    'Qwen3ForCausalLM' object has no attribute ''`), and `ReftModel.load` finds no intervention width in
    `type_to_dimension_mapping` (KeyError). Register the model's class in both, from the model: its decoder layer list
    (with its layers' `mlp` and `self_attn`, transformers' names, for the other COMPONENTS) and the hidden size of its
    (text) config. A class pyvene maps keeps pyvene's own layout."""
    model_class = type(model)
    if model_class in pyvene.type_to_module_mapping:
        return
    layers = decoder_layer_list(model)
    text_config = model.config.get_text_config(decoder=True)
    # a config attribute path, as pyvene's own tables give it: the class has models of many widths
    text_config_name = next((name for name, value in vars(model.config).items() if value is text_config), None)
    layer = model.get_submodule(layers)[0]
    modules = {"block_output": f"{layers}[%s]", "mlp_output": f"{layers}[%s].mlp",
               "attention_output": f"{layers}[%s].self_attn"}
    modules = {component: path for component, path in modules.items()
               if component == "block_output" or hasattr(layer, path.rpartition(".")[2])}
    hidden_size = ".".join(name for name in (text_config_name, "hidden_size") if name)
    pyvene.type_to_module_mapping[model_class] = {component: (path, CONST_OUTPUT_HOOK)
                                                  for component, path in modules.items()}
    pyvene.type_to_dimension_mapping[model_class] = {component: (hidden_size,) for component in modules}


def quiet_bitsandbytes_logs() -> None:
    """Drop two warnings of bitsandbytes 0.50 that say nothing to act on (only they): "MatMul8bitLt: inputs will
    be cast ... to float16", logged at every forward of every 8-bit layer whose input is not float16 (thousands of
    lines a step; the cast is LLM.int8's own arithmetic, docs/big-models.md says so once), and, on CPUs with
    AVX512-BF16, "Failed to load CPU gemm_4bit_forward from kernels-community" at import, which asks for a
    package that downloads a kernel from the hub, for the inference kernel training never runs
    (`keep_4bit_layers_differentiable`)."""
    for logger in ("bitsandbytes.autograd._functions", "bitsandbytes.backends.cpu.ops"):
        logging.getLogger(logger).addFilter(_not_bitsandbytes_noise)  # once: a filter already there is not added


def _not_bitsandbytes_noise(record) -> bool:
    return not str(record.msg).startswith(("MatMul8bitLt: inputs will be cast", "Failed to load CPU gemm_4bit_forward"))


def keep_4bit_layers_differentiable(model) -> None:
    """Keep 4-bit layers on bitsandbytes' differentiable path. bitsandbytes 0.50, on a CPU with AVX512-BF16, repacks a
    4-bit layer's weight for its inference kernel at the first forward it sees in eval mode without gradient (the frozen
    base is always in eval mode: evaluation, the first layer's input), in place and for good; that kernel has no
    backward, so from then on the gradient through the layer is wrong (torch warns "an autograd kernel was not
    registered"), and the forward's arithmetic changes mid-run. Kept off: every forward takes bitsandbytes'
    differentiable path (dequantize, then matmul)."""
    import bitsandbytes as bnb  # here: only a quantized base needs it, after `quiet_bitsandbytes_logs`

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
