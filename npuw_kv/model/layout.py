"""Discovery of the KV-cache layout of a stateless LLM graph.

Names are not trusted: after stateful->stateless conversion the GGUF-converted IR names its V
outputs ``present.{i}.key`` just like the K outputs.  Each past input is therefore paired with
its present output by following the graph: ``past -> Concat(axis=seq) -> Result``.  K and V are
told apart by the input name (``...key`` / ``...value``), which the conversion keeps distinct.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import openvino as ov

from ..errors import ModelLayoutError

_PAST_RE = re.compile(r"past_key_values\.(\d+)\.(key|value)$")


@dataclass(frozen=True)
class KVPort:
    """One past input and the present output it feeds (by graph structure)."""

    layer: int
    kind: str  # "key" or "value"
    input_name: str
    output_index: int  # index into model.outputs of the present output
    num_heads: int
    head_dim: int
    seq_axis: int  # 2: [1, heads, seq, head_dim]; 3: V transposed, [1, heads, head_dim, seq]
    precision: str  # "f32", "f16" or "bf16": the element type of the KV input / output

    def shape(self, seq: ov.Dimension | int) -> list:
        """This port's past (or present) shape with ``seq`` slots, along its own seq axis."""
        if self.seq_axis == 3:
            return [1, self.num_heads, self.head_dim, seq]
        return [1, self.num_heads, seq, self.head_dim]


@dataclass(frozen=True)
class KVLayout:
    """All KV ports of a model, ordered by (layer, kind)."""

    ports: tuple[KVPort, ...]
    logits_output_index: int
    window: tuple[int | None, ...]  # attention window per layer (None = full attention)
    # (window, slots): sliding windows whose layers keep their KV in a ring of that many slots
    # on the static-shape path (model/ring.py); their past inputs are that long in every model
    rings: tuple[tuple[int, int], ...] = ()

    def ring_of(self, layer: int) -> int | None:
        """The ring slots of ``layer``'s KV, or None when it holds the whole past."""
        window = self.window[layer]
        return next((slots for w, slots in self.rings if w == window), None)

    @property
    def num_layers(self) -> int:
        return len({p.layer for p in self.ports})

    @property
    def num_kv_heads(self) -> int:
        return self.ports[0].num_heads

    @property
    def head_dim(self) -> int:
        return self.ports[0].head_dim

    @property
    def precision(self) -> str:
        return self.ports[0].precision

    def with_precision(self, precision: str) -> KVLayout:
        """The same layout with the cache stored as ``precision`` (after set_kv_precision)."""
        return replace(self, ports=tuple(replace(p, precision=precision) for p in self.ports))

    @property
    def values_transposed(self) -> bool:
        """Whether V is stored transposed, ``[1, heads, head_dim, seq]`` (optimize_v_tensors)."""
        return any(p.kind == "value" and p.seq_axis == 3 for p in self.ports)

    def with_values_transposed(self) -> KVLayout:
        """The same layout with every V port's sequence on axis 3 (after the V rewrite)."""
        return replace(
            self,
            ports=tuple(replace(p, seq_axis=3) if p.kind == "value" else p for p in self.ports),
        )

    def bytes_per_token(self) -> int:
        itemsize = 4 if self.precision == "f32" else 2
        return sum(p.num_heads * p.head_dim * itemsize for p in self.ports)


def _concat_consumer(param: ov.Node) -> ov.Node:
    for target in param.output(0).get_target_inputs():
        node = target.get_node()
        if node.get_type_name() == "Concat":
            return node
    raise ModelLayoutError(
        f"past input {param.get_friendly_name()!r} does not feed a Concat; "
        "not a KV-cache graph this tool understands"
    )


def discover_layout(model: ov.Model) -> KVLayout:
    """Pair every ``past_key_values.{i}.{key,value}`` input with its present output."""
    result_index = {out.get_node(): i for i, out in enumerate(model.outputs)}
    logits_idx = next(
        (i for i, out in enumerate(model.outputs) if "logits" in out.get_names()), None
    )
    if logits_idx is None:
        raise ModelLayoutError("model has no 'logits' output; is it a causal LM?")

    ports: list[KVPort] = []
    for param in model.get_parameters():
        name = param.get_friendly_name()
        names = param.output(0).get_names() | {name}
        match = next((m for n in names if (m := _PAST_RE.match(n))), None)
        if match is None:
            continue
        concat = _concat_consumer(param)
        results = [
            t.get_node()
            for t in concat.output(0).get_target_inputs()
            if t.get_node().get_type_name() == "Result"
        ]
        if len(results) != 1:
            raise ModelLayoutError(f"past input {name!r}: expected one present output")
        pshape = param.get_output_partial_shape(0)
        if pshape.rank.get_length() != 4:
            raise ModelLayoutError(f"past input {name!r} has rank {pshape.rank}, expected 4")
        axis = int(concat.get_attributes()["axis"])
        axis = axis if axis >= 0 else axis + 4
        heads, head_dim = pshape[1], pshape[3]
        if axis != 2 or not heads.is_static or not head_dim.is_static:
            raise ModelLayoutError(
                f"past input {name!r}: expected [batch, kv_heads, seq, head_dim], got {pshape}"
            )
        ports.append(
            KVPort(
                layer=int(match.group(1)),
                kind=match.group(2),
                input_name=match.group(0),
                output_index=result_index[results[0]],
                num_heads=heads.get_length(),
                head_dim=head_dim.get_length(),
                seq_axis=axis,
                precision=param.get_element_type().get_type_name(),
            )
        )
    if not ports:
        raise ModelLayoutError(
            "model has no past_key_values inputs after stateless conversion: "
            "not a decoder LLM with KV states"
        )
    ports.sort(key=lambda p: (p.layer, p.kind != "key"))
    layers = sorted({p.layer for p in ports})
    if layers != list(range(len(layers))) or len(ports) != 2 * len(layers):
        raise ModelLayoutError(f"incomplete KV ports: layers {layers}, {len(ports)} ports")
    return KVLayout(tuple(ports), logits_idx, tuple(None for _ in layers))
