"""The SGLang behaviours megarl's CPU engine enforces, read from the installed sglang's own source files.

megarl's CPU engine server stands in for ``sglang.launch_server`` in CI; wherever megarl relies on how SGLang
behaves (what a memory release leaves, which tensors its loaders take only together, which models answer a weight
read-back), the engine must be as strict as SGLang, or CI hides the bugs a cluster run would hit. Each function
here reads one such behaviour from the pinned sglang (0.5.23) with :mod:`ast`, never importing it (its modules need
GPU-only packages), so ``tests/unit/test_sglang_rules.py`` can hold the engine's rules to what SGLang does and fail
when a new sglang changes it. The reading is narrow on purpose: a source of another shape raises
:class:`~tests.sglang_source.SGLangSourceError` naming the file, rather than passing vacuously.
"""

from __future__ import annotations

import ast
import dataclasses
import functools

from tests.sglang_source import SGLangSourceError, _classes, _functions, _imports, _tree, sglang_root

EXEC_FIELDS = "srt/arg_groups/fields/exec_.py"
LOAD_MODEL = "srt/model_executor/model_runner_components/load_model_utils.py"
SCHEDULER_WEIGHTS = "srt/managers/scheduler_components/weight_updater.py"
DEEPSEEK_LOADER = "srt/models/deepseek_common/deepseek_weight_loader.py"
WEIGHT_EXPORTER = "srt/model_executor/model_runner_components/weight_exporter.py"


def _function(relative: str, name: str) -> ast.FunctionDef:
    func = _functions(relative).get(name)
    if func is None:
        raise SGLangSourceError(f"sglang {relative} has no function {name}")
    return func


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _dotted(node: ast.AST) -> str:
    return ast.unparse(node)


# --------------------------------------------------------------------------------------------
# Memory release: what released weights hold
# --------------------------------------------------------------------------------------------


def server_flag_default(relative: str, field: str):
    """The default value of a ``ServerArgs`` namespace field (``field: A[T, "help"] = default``) in ``relative``."""
    for cls in _classes(relative).values():
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == field:
                if node.value is None:
                    raise SGLangSourceError(f"{relative}: {field} has no default")
                return ast.literal_eval(node.value)
    raise SGLangSourceError(f"{relative} has no field {field}")


def weights_region_cpu_backup() -> str:
    """The setting the weights' memory-saver region takes its CPU backup from: the source of the value passed as
    ``enable_cpu_backup=`` to ``memory_saver_adapter.region(GPU_MEMORY_TYPE_WEIGHTS, ...)`` when the model loads,
    with a local variable replaced by everything it is assigned (`` | ``-separated: the flag, and ``False`` where
    SGLang turns the backup off for IPC-shared weights, which megarl does not use)."""
    func = _function(LOAD_MODEL, "load_model_with_memory_saver")
    assigned: dict[str, list[str]] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(_dotted(node.value))
    for call in _calls(func):
        if (_dotted(call.func).endswith("memory_saver_adapter.region") and call.args
                and _dotted(call.args[0]) == "GPU_MEMORY_TYPE_WEIGHTS"):
            value = next((k.value for k in call.keywords if k.arg == "enable_cpu_backup"), None)
            if value is None:
                return "False"
            if isinstance(value, ast.Name) and value.id in assigned:
                return " | ".join(assigned[value.id])
            return _dotted(value)
    raise SGLangSourceError(f"{LOAD_MODEL}: load_model_with_memory_saver opens no GPU_MEMORY_TYPE_WEIGHTS region")


def released_tags_paused(method: str = "release_memory_occupation") -> dict[str, str]:
    """``{memory tag constant: the memory-saver call made for it}`` in the scheduler's ``method``
    (``pause`` on release, ``resume`` on resume): ``if GPU_MEMORY_TYPE_X in tags: ... memory_saver_adapter.<call>(X)``."""
    func = _function(SCHEDULER_WEIGHTS, method)
    out = {}
    for node in ast.walk(func):
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and isinstance(node.test.ops[0], ast.In)
                and _dotted(node.test.comparators[0]) == "tags"):
            tag = _dotted(node.test.left)
            for call in _calls(ast.Module(body=node.body, type_ignores=[])):
                if _dotted(call.func).startswith("self.memory_saver_adapter.") and call.args \
                        and _dotted(call.args[0]) == tag:
                    out[tag] = _dotted(call.func).rsplit(".", 1)[1]
    return out


def static_state_kept() -> frozenset[str]:
    """What SGLang copies out before releasing the weights and back after resuming them: the ``model.<method>()``
    calls of ``_export_static_state`` (``named_buffers``: the buffers, never the parameters)."""
    func = _function(SCHEDULER_WEIGHTS, "_export_static_state")
    return frozenset(call.func.attr for call in _calls(func)
                     if isinstance(call.func, ast.Attribute) and _dotted(call.func.value) == "model")


# --------------------------------------------------------------------------------------------
# Loaders: tensors taken only within one request
# --------------------------------------------------------------------------------------------


@functools.cache
def _model_files() -> tuple[str, ...]:
    root = sglang_root() / "srt" / "models"
    return tuple(str(p.relative_to(sglang_root())) for p in sorted(root.rglob("*.py")))


@functools.cache
def entry_file(architecture: str) -> str:
    """The sglang model file whose ``EntryClass`` serves ``architecture`` (an HF ``architectures`` entry)."""
    for relative in _model_files():
        for node in _tree(relative).body:
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass"
                                                     for t in node.targets)):
                names = [e.id for e in (node.value.elts if isinstance(node.value, (ast.List, ast.Tuple))
                                        else [node.value]) if isinstance(e, ast.Name)]
                if architecture in names:
                    return relative
    raise SGLangSourceError(f"no sglang model file has {architecture} in its EntryClass")


def _module_relative(module: str) -> str | None:
    rel = module.removeprefix("sglang.").replace(".", "/")
    for candidate in (f"{rel}.py", f"{rel}/__init__.py"):
        if (sglang_root() / candidate).is_file():
            return candidate
    return None


def class_mro(relative: str, name: str) -> list[tuple[str, ast.ClassDef]]:
    """``(file, class)`` of ``name`` defined in (or imported into) ``relative`` and its sglang base classes,
    depth first in declaration order (enough for SGLang's single-inheritance models and their mixins)."""
    out, seen = [], set()

    def visit(where: str, cls_name: str) -> None:
        cls = _classes(where).get(cls_name)
        if cls is None:
            imported = _imports(_tree(where)).get(cls_name)
            target = _module_relative(imported[0]) if imported and imported[0].startswith("sglang.") else None
            if target is None:
                return  # torch's nn.Module and other non-sglang bases
            where, cls_name = target, imported[1]
            cls = _classes(where).get(cls_name)
            if cls is None:
                return
        if (where, cls_name) in seen:
            return
        seen.add((where, cls_name))
        out.append((where, cls))
        for base in cls.bases:
            if isinstance(base, ast.Name):
                visit(where, base.id)

    visit(relative, name)
    if not out:
        raise SGLangSourceError(f"{relative} has no class {name}")
    return out


@dataclasses.dataclass(frozen=True)
class RequestCache:
    """A dict local to one ``load_weights`` call that the loop over the request's tensors fills: what it holds is
    used only if the same request brings its partners, and dropped with the call otherwise."""

    source: str
    """``file:function:line``."""
    variable: str
    keys: frozenset[str]
    """The string constants the assignments into it are guarded by (``"q_a_proj" in name``): what it collects."""


def _load_methods(mro: list[tuple[str, ast.ClassDef]]) -> list[tuple[str, ast.FunctionDef]]:
    """``load_weights`` of the first class in ``mro`` that defines it, and the ``self.<method>`` calls it makes to
    methods of the MRO, transitively."""
    methods: dict[str, tuple[str, ast.FunctionDef]] = {}
    for where, cls in mro:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                methods.setdefault(node.name, (where, node))
    if "load_weights" not in methods:
        raise SGLangSourceError(f"{mro[0][0]}: {mro[0][1].name} has no load_weights")
    todo, out, seen = ["load_weights"], [], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        out.append(methods[name])
        for call in _calls(methods[name][1]):
            if isinstance(call.func, ast.Attribute) and _dotted(call.func.value) == "self":
                todo.append(call.func.attr)
    return out


def _is_dict_value(node: ast.AST) -> bool:
    """An empty dict made to collect into: ``{}``, ``dict()``, ``defaultdict(...)`` (or one of them under an ``if``
    expression); never ``dict(self.named_parameters())`` and other copies."""
    if isinstance(node, ast.IfExp):
        return _is_dict_value(node.body) or _is_dict_value(node.orelse)
    if isinstance(node, ast.Dict):
        return not node.keys
    return isinstance(node, ast.Call) and (
        (_dotted(node.func) in ("dict", "OrderedDict") and not node.args and not node.keywords)
        or _dotted(node.func) in ("defaultdict", "collections.defaultdict"))


def request_caches(architecture: str) -> list[RequestCache]:
    """The :class:`RequestCache` s of the loader of ``architecture`` (its ``load_weights`` and the methods it calls
    on itself): every local dict that a loop over the weights fills, by subscript assignment or by handing it to a
    helper; its keys are the string constants of the innermost ``if`` around that."""
    relative = entry_file(architecture)
    out = []
    for where, func in _load_methods(class_mro(relative, architecture)):
        local_dicts = {t.id for node in ast.walk(func) if isinstance(node, ast.Assign) and _is_dict_value(node.value)
                       for t in node.targets if isinstance(t, ast.Name)}
        local_dicts |= {node.target.id for node in ast.walk(func) if isinstance(node, ast.AnnAssign)
                        and isinstance(node.target, ast.Name) and node.value is not None
                        and _is_dict_value(node.value)}
        parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
        for loop in (n for n in ast.walk(func) if isinstance(n, (ast.For, ast.AsyncFor))):
            for node in ast.walk(loop):
                filled = None
                if isinstance(node, ast.Assign):
                    filled = next((t.value.id for t in node.targets if isinstance(t, ast.Subscript)
                                   and isinstance(t.value, ast.Name) and t.value.id in local_dicts), None)
                elif isinstance(node, ast.Call):
                    filled = next((arg.id for arg in node.args if isinstance(arg, ast.Name) and arg.id in local_dicts),
                                  None)
                if filled is None:
                    continue
                guard = parents.get(node)
                while guard is not None and not isinstance(guard, ast.If) and guard is not loop:
                    guard = parents.get(guard)
                keys = frozenset(c.value for c in ast.walk(guard.test) if isinstance(c, ast.Constant)
                                 and isinstance(c.value, str)) if isinstance(guard, ast.If) else frozenset()
                out.append(RequestCache(f"{where}:{func.name}:{node.lineno}", filled, keys))
    return sorted(set(out), key=lambda c: c.source)


def fused_parameter(cache: RequestCache) -> str | None:
    """The parameter a request cache's tensors are loaded into once complete: the name its members' names are
    rewritten to (``name.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")``) in the function that fills it."""
    path, func_name, _ = cache.source.split(":")
    func = _function(path, func_name)
    for call in _calls(func):
        if (isinstance(call.func, ast.Attribute) and call.func.attr == "replace" and len(call.args) == 2
                and isinstance(call.args[0], ast.Constant) and call.args[0].value in cache.keys
                and isinstance(call.args[1], ast.Constant) and call.args[1].value not in cache.keys):
            return call.args[1].value
    return None


# --------------------------------------------------------------------------------------------
# Weight read-back
# --------------------------------------------------------------------------------------------


def reads_weights_back(architecture: str) -> bool:
    """Whether SGLang's model class for ``architecture`` (or a base class of it) defines ``get_weights_by_name``,
    which the model runner calls for ``/get_weights_by_name`` (``weight_exporter.py``; without it the call raises,
    is logged, and the route answers an error)."""
    func = _function(WEIGHT_EXPORTER, "get_weights_by_name")
    if not any(_dotted(call.func).endswith("get_model().get_weights_by_name") for call in _calls(func)):
        raise SGLangSourceError(f"{WEIGHT_EXPORTER}: get_weights_by_name no longer asks the model")
    for _, cls in class_mro(entry_file(architecture), architecture):
        if any(isinstance(n, ast.FunctionDef) and n.name == "get_weights_by_name" for n in cls.body):
            return True
    return False


LLAMA = "srt/models/llama.py"
VOCAB_EMBEDDING = "srt/layers/vocab_parallel_embedding.py"
HTTP_SERVER = "srt/entrypoints/http_server.py"


@dataclasses.dataclass(frozen=True)
class LlamaReadBack:
    """How ``LlamaForCausalLM.get_weights_by_name`` answers, read from its source (megarl's CPU engine:
    :mod:`megarl.engines.cpu_engine.read_back`)."""

    stacked: tuple[tuple, ...]
    """``self.stacked_params_mapping`` as assigned in ``__init__``."""
    gathered: tuple[str, ...]
    """The names whose parameter is all-gathered (``"o_proj" in name or ...``)."""
    gather_dim: int
    """The ``torch.cat`` dimension of the gathered shards."""
    head_dim: str
    """The source of the head size the q/k/v narrows count in."""
    tp_divided: tuple[str, ...]
    """The config fields divided by ``tp_size`` for the narrows."""
    tied_head_reads: str
    """What a tied ``lm_head.weight`` answers (the source of the returned parameter)."""
    rows: str
    """The answer's final expression (how ``truncate_size`` applies)."""


def llama_read_back() -> LlamaReadBack:
    """The rules of SGLang's Llama read-back, read from ``llama.py``."""
    cls = _classes(LLAMA).get("LlamaForCausalLM")
    if cls is None:
        raise SGLangSourceError(f"{LLAMA} has no LlamaForCausalLM")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    stacked = None
    for node in ast.walk(methods["__init__"]):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and _dotted(node.targets[0]) == "self.stacked_params_mapping"):
            stacked = tuple(ast.literal_eval(node.value))
    func = methods.get("get_weights_by_name")
    if stacked is None or func is None:
        raise SGLangSourceError(f"{LLAMA}: LlamaForCausalLM has no stacked_params_mapping or get_weights_by_name")
    gathered, gather_dim, head_dim, divided, tied, rows = (), None, None, [], None, None
    for node in ast.walk(func):
        if isinstance(node, ast.If) and "tp_size > 1" in _dotted(node.test):
            gathered = tuple(c.left.value for c in ast.walk(node.test)
                             if isinstance(c, ast.Compare) and isinstance(c.ops[0], ast.In)
                             and isinstance(c.left, ast.Constant))
            cat = next(c for c in _calls(node) if _dotted(c.func) == "torch.cat")
            gather_dim = next(k.value.value for k in cat.keywords if k.arg == "dim")
        if isinstance(node, ast.Assign) and _dotted(node.targets[0]) == "head_dim":
            head_dim = _dotted(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and _dotted(node.right) == "tp_size":
            divided.append(_dotted(node.left).removeprefix("self.config."))
        if isinstance(node, ast.If) and "tie_word_embeddings" in _dotted(node.test):
            tied = _dotted(next(n for n in ast.walk(node) if isinstance(n, ast.Return)).value)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Subscript) and rows is None:
            rows = _dotted(node.value)
    if None in (gather_dim, head_dim, tied, rows) or not gathered:
        raise SGLangSourceError(f"{LLAMA}: LlamaForCausalLM.get_weights_by_name is of another shape")
    return LlamaReadBack(stacked, gathered, gather_dim, head_dim, tuple(divided), tied, rows)


def vocab_padding() -> int:
    """SGLang's ``DEFAULT_VOCAB_PADDING_SIZE`` (vocabulary rows padded to a multiple of it, then sharded)."""
    return ast.literal_eval(module_assignment(VOCAB_EMBEDDING, "DEFAULT_VOCAB_PADDING_SIZE"))


def read_back_failure() -> str:
    """The error message the ``/get_weights_by_name`` route answers when the model returns nothing."""
    func = _function(HTTP_SERVER, "get_weights_by_name")
    for call in _calls(func):
        if _dotted(call.func) == "_create_error_response" and isinstance(call.args[0], ast.Constant):
            return call.args[0].value
    raise SGLangSourceError(f"{HTTP_SERVER}: get_weights_by_name answers no constant error")


# --------------------------------------------------------------------------------------------
# FP8: what an engine holds after loading
# --------------------------------------------------------------------------------------------

DEEPGEMM_CONFIG = "srt/layers/deep_gemm_wrapper/configurer.py"
FP8_UTILS = "srt/layers/quantization/fp8_utils.py"


def module_assignment(relative: str, name: str) -> str:
    """The source of the module-level assignment to ``name`` in ``relative``."""
    for node in _tree(relative).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return _dotted(node.value)
    raise SGLangSourceError(f"{relative} assigns no {name}")


def ue8m0_requantization() -> list[str]:
    """What ``requant_weight_ue8m0`` calls, in order (the weight dequantized, then quantized to UE8M0 scales)."""
    func = _function(FP8_UTILS, "requant_weight_ue8m0")
    return [_dotted(call) for call in _calls(func) if isinstance(call.func, ast.Name)]
