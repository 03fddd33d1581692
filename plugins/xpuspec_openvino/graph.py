"""Surgery on a stateful OpenVINO LLM graph: pipeline-stage split, logits of the last positions only,
an LM head cut to some tokens.

All work on the IRs optimum-intel exports (``text-generation-with-past``), whose operation names
carry the PyTorch module path (``__module.model.layers.3.self_attn/...``, weights
``self.model.layers.3.mlp.up_proj.weight``) and whose KV-cache variables are named
``past_key_values.<layer>.keypresent.<layer>.key`` / ``...value``.

Stage split: stage s of N holds the decoder layers ``[a_s, b_s)``. Stage 0 keeps the embedding,
the last stage the final norm and the LM head (with tied embeddings the last stage also holds
the embedding matrix, as its head). Stage s > 0 takes the residual stream entering layer ``a_s``
as a new input ``hidden_states_in`` (float32 ``[batch, seq, hidden]``); stage s < N-1 returns the
residual stream leaving layer ``b_s - 1`` as output ``hidden_states``. Each stage keeps the KV-cache
variables of its own layers only. The exporter computes the past length (for the causal mask)
from layer 0's cache; a later stage reads it from its own first layer's cache instead, which has
the same shape.
"""

import re
from typing import List, Optional, Sequence

import numpy as np
import openvino as ov
from openvino import opset13

from xpuspec.errors import ModelSourceError

HIDDEN_IN = "hidden_states_in"
HIDDEN_OUT = "hidden_states"
LOGITS_TO_KEEP = "logits_to_keep"

_LAYER = re.compile(r"\blayers\.(\d+)\b")
_KV_VARIABLE = re.compile(r"^past_key_values\.(\d+)\.(key|value)present\.\1\.(key|value)$")


def layer_of(node) -> Optional[int]:
    """The decoder layer an operation or weight belongs to, from its name; ``None`` for shared ones."""
    match = _LAYER.search(node.get_friendly_name())
    return int(match.group(1)) if match else None


def _kv_layer(variable_id: str) -> int:
    match = _KV_VARIABLE.match(variable_id)
    if match is None:
        raise ModelSourceError(
            f"KV-cache variable {variable_id!r} is not named past_key_values.<layer>.key/value as optimum-intel "
            "exports it, so xpuspec cannot tell which layer it belongs to. Re-export the model with `xpuspec export`.")
    return int(match.group(1))


def num_layers(model: ov.Model) -> int:
    """Decoder layers of a stateful LLM IR (counted from its KV-cache variables)."""
    return len({_kv_layer(v.get_info().variable_id) for v in model.get_variables()})


def constant_bytes(model: ov.Model) -> int:
    """Bytes of all constants (weights, scales, zero points) an IR holds."""
    return sum(op.get_byte_size() for op in model.get_ordered_ops() if op.get_type_name() == "Constant")


def layer_bytes(model: ov.Model) -> List[int]:
    """Weight bytes of each decoder layer, in layer order."""
    sizes = [0] * num_layers(model)
    for op in model.get_ordered_ops():
        layer = layer_of(op) if op.get_type_name() == "Constant" else None
        if layer is not None and layer < len(sizes):
            sizes[layer] += op.get_byte_size()
    return sizes


def _residual_into(model: ov.Model, layer: int) -> ov.Output:
    """The residual-stream tensor entering ``layer``: produced in layer-1 and used by ``layer`` alone."""
    found = []
    for op in model.get_ordered_ops():
        if layer_of(op) != layer - 1:
            continue
        for out in op.outputs():
            users = {layer_of(i.get_node()) for i in out.get_target_inputs()}
            if layer in users and layer - 1 not in users:
                found.append(out)
    if len(found) != 1:
        raise ModelSourceError(
            f"Cannot find the hidden states between layers {layer - 1} and {layer} in this IR ({len(found)} "
            "candidates), so it cannot be split into pipeline stages. Split IRs exported by optimum-intel "
            "(`xpuspec export`), or run the model on one device.")
    return found[0]


#: Name of the output holding the residual stream entering layer ``i`` (:func:`add_taps`).
TAP = "tap.{}"


def add_taps(model: ov.Model, layer_ids: Sequence[int]) -> List[str]:
    """Add an output for the residual stream entering each of ``layer_ids`` (1 .. L-1), the hidden states an
    EAGLE-3 head drafts from: a Result on the tensor layer ``i - 1`` hands to layer ``i`` (the tensor the pipeline
    split cuts at). Changes ``model`` in place; returns the new outputs' names (:data:`TAP`), in the order given.

    Raises:
        ModelSourceError: an id outside 1 .. L-1, or an IR whose names do not show the hidden states.
    """
    total = num_layers(model)
    names = []
    results = []
    for i in layer_ids:
        if not 1 <= i < total:
            raise ModelSourceError(f"An OpenVINO target can tap the hidden states entering layers 1..{total - 1}, "
                                   f"not layer {i}: use a head whose eagle_aux_hidden_state_layer_ids lie there, or "
                                   "load the target with backend='torch'.")
        result = opset13.result(_residual_into(model, i))
        result.output(0).get_tensor().set_names({TAP.format(i)})
        results.append(result)
        names.append(TAP.format(i))
    model.add_results(results)
    model.validate_nodes_and_infer_types()
    return names


def split_stages(model: ov.Model, counts: Sequence[int]) -> List[ov.Model]:
    """Split a stateful LLM IR into pipeline stages of ``counts`` consecutive layers each.

    Args:
        model: the whole model (left unchanged; each stage is built from a clone).
        counts: layers per stage, each >= 1, summing to :func:`num_layers`.

    Returns:
        One ``ov.Model`` per stage (see the module docstring for their inputs and outputs).

    Raises:
        ModelSourceError: the IR's names do not show its layers or the hidden states between them.
    """
    total = num_layers(model)
    if sum(counts) != total or min(counts) < 1:
        raise ValueError(f"split {list(counts)} must give every stage >= 1 layer and sum to {total} layers.")
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return [_stage(model, a, b, total, f"{model.get_friendly_name()}_stage{s}")
            for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def _stage(model: ov.Model, a: int, b: int, total: int, name: str) -> ov.Model:
    m = model.clone()
    params = list(m.get_parameters())
    if a > 0:
        entering = _residual_into(m, a)
        hidden = opset13.parameter(entering.get_partial_shape(), entering.get_element_type(), name=HIDDEN_IN)
        hidden.output(0).get_tensor().set_names({HIDDEN_IN})
        entering.replace(hidden.output(0))
        params.append(hidden)
    if b < total:
        result = opset13.result(_residual_into(m, b))
        result.output(0).get_tensor().set_names({HIDDEN_OUT})
        results = [result]
    else:
        results = list(m.get_results())
    reads = {op.get_variable_id(): op for op in m.get_ordered_ops() if op.get_type_name() == "ReadValue"}
    for variable_id, read in reads.items():
        layer = _kv_layer(variable_id)
        if not a <= layer < b:  # used only for the past length: read this stage's first layer instead
            kind = variable_id.rsplit(".", 1)[1]
            read.output(0).replace(reads[f"past_key_values.{a}.{kind}present.{a}.{kind}"].output(0))
    sinks = [s for s in m.get_sinks() if a <= _kv_layer(s.get_variable_id()) < b]
    stage = ov.Model(results, sinks, params, name)
    used = {op.get_name() for op in stage.get_ordered_ops()}
    for param in params:
        if not any(i.get_node().get_name() in used for i in param.output(0).get_target_inputs()):
            stage.remove_parameter(param)
    stage.validate_nodes_and_infer_types()
    return stage


#: Element-wise operations that may stand between the LM head's MatMul and the ``logits`` output: a dtype Convert,
#: and the final-logit soft-capping ``cap * tanh(x / cap)`` (Gemma-2), whose other inputs are scalar constants.
#: They act on each logit alone, so slicing positions before the head or cutting its rows commutes with them.
_AFTER_HEAD = {"Convert", "Tanh", "Multiply", "Divide"}


def _scalar_constant(node) -> bool:
    """Whether ``node`` is a one-element Constant, or Converts of one (an fp16 IR keeps its scalars in f16)."""
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    return node.get_type_name() == "Constant" and int(np.prod(node.get_output_shape(0))) == 1


def _lm_head(model: ov.Model):
    """The node the ``logits`` come from once :data:`_AFTER_HEAD` operations are passed (the MatMul, in an LLM IR)."""
    node = model.output("logits").get_node().input_value(0).get_node()
    while node.get_type_name() in _AFTER_HEAD:
        sources = [i.get_source_output().get_node() for i in node.inputs()]
        varying = [n for n in sources if not _scalar_constant(n)]
        if len(varying) != 1:
            break
        node = varying[0]
    return node


def keep_last_logits(model: ov.Model, axis: int = 1) -> ov.Model:
    """Add an input ``logits_to_keep`` (int64 ``[1]``): the LM head runs on that many last positions only.

    ``axis`` is the sequence axis of the hidden states entering the head: 1 in the stateful IR
    (``[1, n, hidden]``), 0 in its paged-attention form (``[n, 1, hidden]``).

    A prefill of n tokens then computes one row of logits instead of n (the head is the
    largest matrix of a small model: 151936 x 1536 for Qwen2.5-1.5B). Changes ``model`` in place.

    Raises:
        ModelSourceError: the ``logits`` output does not come from a MatMul (the LM head).
    """
    head = _lm_head(model)
    if head.get_type_name() != "MatMul":
        raise ModelSourceError(f"The logits come from a {head.get_type_name()}, not the LM head's MatMul.")
    keep = opset13.parameter([1], ov.Type.i64, name=LOGITS_TO_KEEP)
    keep.output(0).get_tensor().set_names({LOGITS_TO_KEEP})
    hidden = head.input_value(0)
    start = opset13.negative(keep)
    stop = opset13.constant([2**62], ov.Type.i64)
    step = opset13.constant([1], ov.Type.i64)
    axis = opset13.constant([axis], ov.Type.i64)
    head.input(0).replace_source_output(opset13.slice(hidden, start, stop, step, axis).output(0))
    model.add_parameters([keep])
    model.validate_nodes_and_infer_types()
    return model


#: Operations the LM head's weight passes through on its way to the MatMul (a plain or a compressed weight:
#: NNCF's decompression is Convert, Subtract of the zero point, Multiply by the scale, Reshape of groups).
_HEAD_WEIGHT_OPS = {
    "Convert": lambda node, a: opset13.convert(a[0], node.get_output_element_type(0)),
    "Subtract": lambda node, a: opset13.subtract(a[0], a[1], node.get_attributes()["auto_broadcast"]),
    "Multiply": lambda node, a: opset13.multiply(a[0], a[1], node.get_attributes()["auto_broadcast"]),
    "Reshape": lambda node, a: opset13.reshape(a[0], a[1], node.get_attributes()["special_zero"]),
}


def keep_head_rows(model: ov.Model, token_ids: Sequence[int]) -> List[int]:
    """Make the LM head score ``token_ids`` only: ``logits[..., j]`` becomes the logit of the j-th of them.

    The head gets its own copy of the rows of those ids, of its weight and of the weight's decompression
    constants (scales, zero points), so a step reads ``len(token_ids)`` rows of the head instead of the
    whole vocabulary (FR-Spec: Zhao et al. 2025, "Accelerating Large-Vocabulary Language Models via
    Frequency-Ranked Speculative Sampling"); a weight tied to the embedding stays whole for the embedding.
    Changes ``model`` in place.

    Args:
        model: a stateful or paged LLM IR whose ``logits`` come from a MatMul with a ``[vocab, hidden]``
            weight as its second input.
        token_ids: distinct ids >= 0, in the order of the new logit columns; ids past the head's rows (a
            config.json vocabulary larger than the IR's) are left out.

    Returns:
        The ids the head now scores, in column order.

    Raises:
        ModelSourceError: the head is not such a MatMul, or its weight is computed by other operations than
            NNCF's decompression or stored in fewer than 8 bits.
        ValueError: ``token_ids`` are not distinct, or negative.
    """
    head = _lm_head(model)
    if head.get_type_name() != "MatMul" or not head.get_attributes()["transpose_b"]:
        raise ModelSourceError("The logits do not come from a MatMul with a [vocab, hidden] weight, so the LM head "
                               "cannot be cut to fewer tokens: load the draft with draft_vocab_size=0.")
    vocab = head.get_output_partial_shape(0)[-1].get_length()
    rows = np.asarray(token_ids, dtype=np.int64)
    if len(set(rows.tolist())) != len(rows) or rows.min(initial=0) < 0:
        raise ValueError("token_ids must be distinct ids >= 0.")
    rows = rows[rows < vocab]

    def cut(out: ov.Output) -> ov.Output:
        node = out.get_node()
        kind = node.get_type_name()
        if kind == "Constant":
            shape = list(node.get_output_shape(0))
            if not shape or shape[0] != vocab:
                return out  # a scalar or shared constant: used as it is
            if node.get_output_element_type(0).bitwidth < 8:
                raise ModelSourceError("The LM head is stored in fewer than 8 bits, which xpuspec cannot cut to "
                                       "fewer tokens: load the draft with draft_vocab_size=0.")
            return opset13.constant(node.get_data()[rows], node.get_output_element_type(0)).output(0)
        if kind not in _HEAD_WEIGHT_OPS:
            raise ModelSourceError(f"The LM head's weight passes through {kind} {node.get_friendly_name()!r}, which "
                                   "xpuspec cannot cut to fewer tokens: load the draft with draft_vocab_size=0.")
        inputs = [cut(i.get_source_output()) for i in node.inputs()]
        if kind == "Reshape":  # [vocab, groups, group] -> [vocab, hidden]: the target shape names the vocabulary
            target = inputs[1].get_node().get_data().copy()
            target[0] = len(rows)
            inputs[1] = opset13.constant(target, inputs[1].get_element_type()).output(0)
        copy = _HEAD_WEIGHT_OPS[kind](node, inputs)
        copy.set_friendly_name(node.get_friendly_name() + "/head_rows")
        return copy.output(0)

    head.input(1).replace_source_output(cut(head.input_value(1)))
    model.validate_nodes_and_infer_types()
    return rows.tolist()
