"""SGLang's HTTP wire format, read from the installed sglang's own source files.

The contract test checks megarl's HTTP client and CPU engine server against the
pinned sglang: the routes ``sglang/srt/entrypoints/http_server.py`` registers, the request
types of ``sglang/srt/managers/io_struct.py``, what each route's handler answers, and the
flags ``python -m sglang.launch_server`` accepts. Importing those modules needs GPU-only
dependencies (and takes seconds), so this module never imports sglang: it finds the package
with ``importlib.util.find_spec`` and parses the files with :mod:`ast`.

What the pinned sources (0.5.23) look like, and so what this reader handles:

- Routes: ``@app.get/post/put/delete/head/api_route/websocket(path, methods=[...])``
  decorators (stacked decorators register one function under several paths), the path a
  string literal or ``os.environ.get("VAR", "/default")`` (the default counts), routes defined
  under an ``if`` (marked :attr:`Route.conditional`), ``app.add_api_route(...)`` calls and
  ``app.include_router(router)`` of routers imported from other modules
  (``v1_loads.router``, ``elastic_ep.router``; their ``@router.get/post`` routes count too).
- Request types: ``GenerateReqInput`` and ``EmbeddingReqInput`` are ``@dataclass`` es; every
  other request and output type is a ``msgspec.Struct`` subclass of ``BaseReq`` (fields
  ``rid``, ``http_worker_ipc``) or ``BaseBatchReq`` (``rids``, ``http_worker_ipcs``).
  :func:`dataclass_fields` reads both kinds, base-class fields first. Handlers take them as
  ``obj: X`` or ``obj: Annotated[X, Body()]``. FastAPI builds them with pydantic, which
  ignores unknown JSON keys (``msgspec_struct_pydantic_core_schema`` uses
  ``extra_behavior="ignore"``).
- Responses: what a handler returns, read from its ``return`` statements
  (:func:`route_responses`): ``ORJSONResponse(content, status_code=...)``, ``Response(...)``,
  ``_create_error_response(e)``, dict literals, a local dict built up by subscript
  assignment, a call to another handler, or falling off the end (FastAPI then sends JSON
  ``null``). Where the body comes from the tokenizer manager, the source it is built in is
  read instead: ``/generate`` (``tokenizer_manager.py``, ``weight_versions.py`` and the
  generated schema ``sglang/api/v1/api_types.py``) and ``/get_weights_by_name`` (a JSON list).
- ``ServerArgs`` is assembled from the ``msgspec.Struct`` namespaces of
  ``sglang/srt/arg_groups/fields/`` listed in ``server_args._INPUT_NAMESPACES``; its CLI flags
  are derived from each field's ``A[T, "help"]`` / ``A[T, Arg(cli_name=..., aliases=...,
  no_cli=...)]`` annotation (``arg_utils.add_cli_args_from_dataclass``), plus the few
  ``parser.add_argument(...)`` calls of ``ServerArgs.add_cli_args``.

Every function raises :class:`SGLangSourceError` (naming the file and what was missing) when
sglang is not installed or a source does not have the expected shape, so a changed sglang
fails the contract test loudly instead of passing it vacuously.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import http
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

IO_STRUCT = "srt/managers/io_struct.py"
HTTP_SERVER = "srt/entrypoints/http_server.py"
TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"
TOKENIZER_CONTROL = "srt/managers/tokenizer_control_mixin.py"
WEIGHT_VERSIONS = "srt/utils/weight_versions.py"
REQ_TIME_STATS = "srt/observability/req_time_stats.py"
SCHEDULE_BATCH = "srt/managers/schedule_batch.py"
API_TYPES = "api/v1/api_types.py"
SERVER_ARGS = "srt/server_args.py"
CONSTANTS = "srt/constants.py"
LOAD_SNAPSHOT = "srt/managers/load_snapshot.py"

ROUTE_DECORATORS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH",
                    "head": "HEAD", "options": "OPTIONS", "trace": "TRACE"}
"""FastAPI/APIRouter decorator name -> the HTTP method it registers (``api_route``/``route`` take
``methods=``, default ``GET``; ``websocket`` registers ``WEBSOCKET``)."""


class SGLangSourceError(RuntimeError):
    """sglang is not installed, or one of its sources does not have the shape this reader expects."""


# --------------------------------------------------------------------------------------------
# Locating and parsing the installed package
# --------------------------------------------------------------------------------------------


@functools.cache
def sglang_root() -> Path:
    """The installed ``sglang`` package directory (``.../site-packages/sglang``)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SGLangSourceError("sglang is not installed: the SGLang wire-format contract is read from its sources; "
                                "install the pinned version with `pip install --no-deps sglang==0.5.23`")
    return Path(next(iter(spec.submodule_search_locations)))


def sglang_version() -> str:
    """The installed sglang's version (package metadata)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError as exc:
        raise SGLangSourceError("sglang is not installed (no package metadata for 'sglang')") from exc


def source_path(relative: str) -> Path:
    """The file ``relative`` (e.g. ``"srt/managers/io_struct.py"``) of the installed sglang."""
    path = sglang_root() / relative
    if not path.is_file():
        raise SGLangSourceError(f"sglang {sglang_version()} has no {path}: the SGLang wire-format reader expects it")
    return path


@functools.cache
def _tree(relative: str) -> ast.Module:
    path = source_path(relative)
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _module_file(module: str) -> str:
    """``sglang.srt.x.y`` -> ``srt/x/y.py`` (relative to the package), or ``.../__init__.py``."""
    if not module.startswith("sglang."):
        raise SGLangSourceError(f"{module} is not an sglang module")
    rel = module.removeprefix("sglang.").replace(".", "/")
    if (sglang_root() / f"{rel}.py").is_file():
        return f"{rel}.py"
    return f"{rel}/__init__.py"


def _imports(tree: ast.Module) -> dict[str, tuple[str, str]]:
    """Local name -> (module, original name) for every ``from sglang... import`` in ``tree`` (any depth)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                out[alias.asname or alias.name] = (node.module, alias.name)
    return out


def _str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return None


@functools.cache
def _functions(relative: str) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function of the file ``relative`` by name, at any depth (a later definition of a name wins)."""
    out = {}
    stack = list(_tree(relative).body)
    while stack:  # statements only: a function is never defined inside an expression
        node = stack.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        for field in ("body", "orelse", "finalbody", "handlers"):
            stack.extend(getattr(node, field, None) or [])
    return out


def _mentions(relative: str, func: ast.AST, word: str) -> bool:
    """Whether the source lines of ``func`` contain ``word`` (a cheap filter before walking it)."""
    return any(word in line for line in _lines(relative)[func.lineno - 1:func.end_lineno])


@functools.cache
def _lines(relative: str) -> tuple[str, ...]:
    return tuple(source_path(relative).read_text(encoding="utf-8").splitlines())


@functools.cache
def _classes(relative: str) -> dict[str, ast.ClassDef]:
    """The top-level classes of the file ``relative`` by name."""
    return {node.name: node for node in _tree(relative).body if isinstance(node, ast.ClassDef)}


# --------------------------------------------------------------------------------------------
# Routes
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Route:
    """One (path, handler) registration of SGLang's HTTP server."""

    path: str
    methods: frozenset[str]
    handler: str
    """The handler function's name."""
    source: str
    """``file:line`` of the handler (relative to the sglang package)."""
    request_type: str | None
    """The ``io_struct`` request type the handler takes as its JSON body, if any."""
    params: tuple[tuple[str, str], ...]
    """The handler's parameters: (name, annotation source text)."""
    conditional: bool
    """Registered inside an ``if`` (depends on an environment variable or server setting)."""
    auth: str = "normal"
    """The handler's ``@auth_level(AuthLevel.X)`` (``normal``, ``admin_optional``, ``admin_force``): with
    ``--admin-api-key`` set, the admin levels need that key (``sglang/srt/utils/auth.py``)."""


def _resolve_path(node: ast.AST, module_strings: dict[str, str]) -> str | None:
    """A route path expression: a literal, ``os.environ.get("VAR", "/default")`` or a module-level constant."""
    if (text := _str(node)) is not None:
        return text
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and len(node.args) == 2 and ast.unparse(node.func.value) == "os.environ"):
        return _str(node.args[1])
    if isinstance(node, ast.Name):
        return module_strings.get(node.id)
    return None


def _unwrap_annotated(node: ast.AST) -> ast.AST:
    """``Annotated[X, ...]`` / ``A[X, ...]`` -> ``X``; anything else unchanged."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in ("Annotated", "A"):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return elts[0]
    return node


def _io_struct_names() -> frozenset[str]:
    return frozenset(_classes(IO_STRUCT))


def _scan_routes(relative: str, owners: set[str], prefix: str = "") -> tuple[list[Route], list[str]]:
    """Routes registered on the objects named ``owners`` in ``relative``, and the ones whose path is not a literal."""
    tree = _tree(relative)
    module_strings = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                      for target in node.targets if isinstance(target, ast.Name) and _str(node.value) is not None}
    io_names = _io_struct_names()
    imports = _imports(tree)
    functions = _functions(relative)
    routes: list[Route] = []
    unresolved: list[str] = []

    def handler_info(func: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str | None, tuple[tuple[str, str], ...]]:
        request_type = None
        params = []
        for arg in func.args.args + func.args.kwonlyargs:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            params.append((arg.arg, annotation))
            inner = _unwrap_annotated(arg.annotation) if arg.annotation is not None else None
            if isinstance(inner, ast.Name) and inner.id in io_names and (
                    inner.id not in imports or imports[inner.id][0] == "sglang.srt.managers.io_struct"):
                request_type = inner.id
        return request_type, tuple(params)

    def add(path_node: ast.AST, methods: frozenset[str], func, conditional: bool, line: int) -> None:
        path = _resolve_path(path_node, module_strings)
        if path is None:
            unresolved.append(f"{relative}:{line}: {ast.unparse(path_node)}")
            return
        request_type, params = handler_info(func) if func is not None else (None, ())
        routes.append(Route(path=prefix + path, methods=methods, handler=func.name if func is not None else "?",
                            source=f"{relative}:{func.lineno if func is not None else line}",
                            request_type=request_type, params=params, conditional=conditional,
                            auth=auth_of(func)))

    def auth_of(func) -> str:
        for deco in getattr(func, "decorator_list", []):
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name) and deco.func.id == "auth_level"
                    and deco.args and isinstance(deco.args[0], ast.Attribute)):
                return deco.args[0].attr.lower()
        return "normal"

    def methods_of(call: ast.Call, attr: str) -> frozenset[str]:
        if attr in ROUTE_DECORATORS:
            return frozenset({ROUTE_DECORATORS[attr]})
        if attr == "websocket":
            return frozenset({"WEBSOCKET"})
        node = _kw(call, "methods")
        if node is None:
            return frozenset({"GET"})
        try:
            return frozenset(method.upper() for method in ast.literal_eval(node))
        except ValueError as exc:
            raise SGLangSourceError(f"{relative}:{call.lineno}: methods={ast.unparse(node)} is not a literal") from exc

    def visit(body: list[ast.stmt], conditional: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for deco in node.decorator_list:
                    if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                            and isinstance(deco.func.value, ast.Name) and deco.func.value.id in owners
                            and deco.func.attr in (*ROUTE_DECORATORS, "api_route", "route", "websocket")):
                        path_node = deco.args[0] if deco.args else _kw(deco, "path")
                        add(path_node, methods_of(deco, deco.func.attr), node, conditional, deco.lineno)
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                call = node.value
                if (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
                        and call.func.value.id in owners
                        and call.func.attr in ("add_api_route", "add_api_websocket_route")):
                    path_node = call.args[0] if call.args else _kw(call, "path")
                    endpoint = call.args[1] if len(call.args) > 1 else _kw(call, "endpoint")
                    func = functions.get(endpoint.id) if isinstance(endpoint, ast.Name) else None
                    methods = (frozenset({"WEBSOCKET"}) if call.func.attr == "add_api_websocket_route"
                               else methods_of(call, "api_route"))
                    add(path_node, methods, func, conditional, call.lineno)
            if isinstance(node, ast.ClassDef):
                continue
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):  # a try's body runs; an if's, a loop's or an except's may not
                    visit(inner, conditional or isinstance(node, (ast.If, ast.While, ast.For, ast.AsyncFor)))
            for handler in getattr(node, "handlers", []) or []:
                visit(handler.body, True)

    visit(tree.body, False)
    return routes, unresolved


@functools.cache
def _all_routes() -> tuple[tuple[Route, ...], tuple[str, ...]]:
    tree = _tree(HTTP_SERVER)
    routes, unresolved = _scan_routes(HTTP_SERVER, {"app"})
    if not routes:
        raise SGLangSourceError(f"found no @app routes in {source_path(HTTP_SERVER)}")
    imports = _imports(tree)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "include_router"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "app"):
            router = node.args[0] if node.args else _kw(node, "router")
            if not isinstance(router, ast.Name) or router.id not in imports:
                raise SGLangSourceError(f"{HTTP_SERVER}:{node.lineno}: cannot follow app.include_router"
                                        f"({ast.unparse(router)}): not a name imported from an sglang module")
            module, original = imports[router.id]
            prefix = _str(_kw(node, "prefix")) or ""
            more, more_unresolved = _scan_routes(_module_file(module), {original}, prefix)
            routes += more
            unresolved += more_unresolved
    return tuple(routes), tuple(unresolved)


def routes() -> tuple[Route, ...]:
    """Every route registration of the HTTP server (including included routers), in source order."""
    return _all_routes()[0]


def unresolved_routes() -> tuple[str, ...]:
    """Route registrations whose path is not known from the source (e.g. an environment variable without default)."""
    return _all_routes()[1]


def http_routes(*, include_conditional: bool = True) -> dict[str, set[str]]:
    """Path -> the HTTP methods SGLang serves it with (every registration of the path merged)."""
    out: dict[str, set[str]] = {}
    for route in routes():
        if include_conditional or not route.conditional:
            out.setdefault(route.path, set()).update(route.methods)
    return out


def route(path: str) -> Route:
    """The (first) registration of ``path``; KeyError naming the path if SGLang does not serve it."""
    for candidate in routes():
        if candidate.path == path:
            return candidate
    raise KeyError(f"sglang {sglang_version()} does not serve {path!r} ({HTTP_SERVER})")


def request_fields(path: str) -> dict[str, str]:
    """Field -> annotation of the request type ``path``'s handler takes (KeyError if it takes no JSON body)."""
    request_type = route(path).request_type
    if request_type is None:
        raise KeyError(f"the handler of {path!r} ({route(path).handler}) takes no io_struct request body")
    return dataclass_fields(request_type)


def route_request_types() -> dict[str, str]:
    """Path -> the ``io_struct`` request type its handler takes as the JSON body (routes taking one)."""
    out: dict[str, str] = {}
    for candidate in routes():
        if candidate.request_type is not None:
            out.setdefault(candidate.path, candidate.request_type)
    return out


# --------------------------------------------------------------------------------------------
# Request types (io_struct.py)
# --------------------------------------------------------------------------------------------


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if ast.unparse(target) in ("dataclass", "dataclasses.dataclass"):
            return True
    return False


@functools.cache
def _record_fields(name: str) -> tuple[str, tuple[tuple[str, str, str | None], ...]]:
    """(kind, ((field, annotation, default-or-None), ...)) of the io_struct record ``name``, base fields first."""
    classes = _classes(IO_STRUCT)
    cls = classes.get(name)
    # aliases: ``LoadLoRAAdapterReqOutput = UnloadLoRAAdapterReqOutput = (LoRAUpdateOutput)``
    for node in _tree(IO_STRUCT).body:
        if (cls is None and isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)
                and node.value.id in classes and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)):
            return _record_fields(node.value.id)
    if cls is None:
        raise KeyError(f"sglang {sglang_version()} defines no class {name!r} in {source_path(IO_STRUCT)}")
    fields: dict[str, tuple[str, str | None]] = {}
    kind = None
    for base in cls.bases:
        base_name = ast.unparse(base)
        if base_name in classes:
            base_kind, base_fields = _record_fields(base_name)
            kind = kind or base_kind
            for field, annotation, default in base_fields:
                fields[field] = (annotation, default)
        elif base_name in ("msgspec.Struct", "Struct"):
            kind = "msgspec.Struct"
    if _is_dataclass(cls):
        kind = "dataclass"
    if kind is None:
        raise KeyError(f"{name} in {source_path(IO_STRUCT)} is neither a @dataclass nor a msgspec.Struct")
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = ast.unparse(node.annotation)
            if annotation.startswith(("ClassVar", "typing.ClassVar")):
                continue
            # a redefined base field keeps the base's position (msgspec and dataclasses both do so)
            fields[node.target.id] = (annotation, ast.unparse(node.value) if node.value is not None else None)
    return kind, tuple((field, annotation, default) for field, (annotation, default) in fields.items())


def record_kind(name: str) -> str:
    """``"dataclass"`` or ``"msgspec.Struct"``: how ``io_struct.<name>`` is declared."""
    return _record_fields(name)[0]


def dataclass_fields(name: str) -> dict[str, str]:
    """Field -> annotation source text of the request/output type ``io_struct.<name>``.

    Covers the ``@dataclass`` es (``GenerateReqInput``, ``EmbeddingReqInput``) and the
    ``msgspec.Struct`` records (all other ``*ReqInput`` / ``*ReqOutput`` / ``AbortReq`` ...),
    including the fields of their io_struct base classes (``BaseReq``: ``rid``,
    ``http_worker_ipc``). KeyError naming the type if io_struct has no such class.
    """
    return {field: annotation for field, annotation, _ in _record_fields(name)[1]}


def dataclass_defaults(name: str) -> dict[str, str | None]:
    """Field -> default value source text (``None``: the field is required) of ``io_struct.<name>``."""
    return {field: default for field, _, default in _record_fields(name)[1]}


def required_fields(name: str) -> frozenset[str]:
    """The fields of ``io_struct.<name>`` without a default (a request lacking one is refused with a 400)."""
    return frozenset(field for field, default in dataclass_defaults(name).items() if default is None)


def literal_values(name: str, field: str) -> tuple[Any, ...]:
    """The allowed values of a ``Literal[...]`` field (e.g. ``PauseGenerationReqInput.mode``)."""
    annotation = dataclass_fields(name)[field]
    node = _unwrap_annotated(ast.parse(annotation, mode="eval").body)
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Optional", "typing.Optional"):
        node = node.slice
    if not (isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Literal", "typing.Literal")):
        raise SGLangSourceError(f"{name}.{field}: {annotation} is not a Literal")
    return tuple(ast.literal_eval(node.slice if isinstance(node.slice, ast.Tuple) else ast.Tuple([node.slice])))


def memory_tags() -> dict[str, str]:
    """``GPU_MEMORY_TYPE_*`` constant -> tag string (``srt/constants.py``): the memory tags SGLang knows."""
    out = {}
    for node in _tree(CONSTANTS).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.startswith("GPU_MEMORY_TYPE_") and _str(node.value) is not None:
                out[name] = node.value.value
    if not out:
        raise SGLangSourceError(f"no GPU_MEMORY_TYPE_* constants in {source_path(CONSTANTS)}")
    return out


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One way a route's handler answers."""

    status: frozenset[int] | None
    """The HTTP status codes of this answer (``None``: not determinable from the source)."""
    body: str
    """``"object"`` (a JSON object, see :attr:`fields`), ``"list"`` (a JSON array), ``"null"`` (JSON ``null``),
    ``"string"`` (a JSON string), ``"empty"`` (no body), ``"text"`` (a plain-text body, not JSON), ``"stream"``
    (server-sent events) or ``"opaque"`` (built elsewhere, not followed)."""
    fields: frozenset[str]
    """For ``"object"`` bodies: the keys, nested ones as dotted paths (``"error.message"``, ``"meta_info.id"``)."""
    open: bool
    """The object may hold keys the source does not name literally (``**spread``, computed keys)."""
    source: str
    """Where the answer is built: ``file:function:line``."""


def _status_values(node: ast.AST | None, local: dict[str, ast.AST]) -> frozenset[int] | None:
    if node is None:
        return frozenset({200})
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return frozenset({node.value})
    text = ast.unparse(node).removesuffix(".value")
    if text.startswith("HTTPStatus.") and text.removeprefix("HTTPStatus.").isidentifier():
        return frozenset({http.HTTPStatus[text.removeprefix("HTTPStatus.")].value})
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and len(node.args) == 3:
        return _status_values(node.args[2], local)  # getattr(exc, "status_code", default): the default
    if isinstance(node, ast.IfExp):
        body, orelse = _status_values(node.body, local), _status_values(node.orelse, local)
        return body | orelse if body is not None and orelse is not None else None
    if isinstance(node, ast.Name) and node.id in local:
        return _status_values(local[node.id], {})
    return None


def _dict_fields(node: ast.Dict, prefix: str = "") -> tuple[set[str], bool]:
    fields, open_ = set(), False
    for key, value in zip(node.keys, node.values):
        if key is None or _str(key) is None:
            open_ = True
            continue
        fields.add(prefix + key.value)
        if isinstance(value, ast.Dict):
            inner, inner_open = _dict_fields(value, prefix + key.value + ".")
            fields |= inner
            open_ |= inner_open
    return fields, open_


def _local_assignments(func: ast.AST) -> dict[str, ast.AST]:
    """Name -> the value of its (last) plain assignment in ``func`` (nested functions excluded)."""
    out: dict[str, ast.AST] = {}
    for node in _walk_own(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value
    return out


def _subscript_keys(func: ast.AST, name: str) -> set[str]:
    """String keys assigned as ``name["key"] = ...`` in ``func``."""
    keys = set()
    for node in _walk_own(func):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == name and _str(target.slice) is not None):
                    keys.add(target.slice.value)
    return keys


def _walk_own(func: ast.AST):
    """``ast.walk`` of a function's body without descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(func))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def _can_complete(stmts: list[ast.stmt]) -> bool:
    """Whether executing ``stmts`` can fall off their end (no ``return``/``raise`` on some path)."""
    if not stmts:
        return True
    last = stmts[-1]
    if isinstance(last, (ast.Return, ast.Raise)):
        return False
    if isinstance(last, ast.If):
        return _can_complete(last.body) or _can_complete(last.orelse)
    if isinstance(last, ast.Try):
        return _can_complete(last.body + last.orelse) or any(_can_complete(h.body) for h in last.handlers)
    if isinstance(last, (ast.With, ast.AsyncWith)):
        return _can_complete(last.body)
    return True


def _content_outcome(content: ast.AST | None, status: frozenset[int] | None, func, where: str,
                     local: dict[str, ast.AST]) -> Outcome:
    """The outcome of a JSON body expression ``content`` returned by ``func``."""
    seen = set()
    while True:
        if isinstance(content, ast.Call) and ast.unparse(content.func) in ("msgspec_to_builtins", "jsonable_encoder"):
            content = content.args[0]
            continue
        if isinstance(content, ast.Name) and content.id in local and content.id not in seen:
            seen.add(content.id)
            name = content.id
            content = local[name]
            if isinstance(content, ast.Dict):
                fields, open_ = _dict_fields(content)
                return Outcome(status, "object", frozenset(fields | _subscript_keys(func, name)), open_, where)
            continue
        break
    if isinstance(content, ast.Dict):
        fields, open_ = _dict_fields(content)
        return Outcome(status, "object", frozenset(fields), open_, where)
    if isinstance(content, (ast.List, ast.ListComp)):
        return Outcome(status, "list", frozenset(), False, where)
    if isinstance(content, ast.Constant) and content.value is None:
        return Outcome(status, "null", frozenset(), False, where)
    if isinstance(content, ast.Constant) and isinstance(content.value, str):
        return Outcome(status, "string", frozenset(), False, where)  # a str returned by a handler: a JSON string
    return Outcome(status, "opaque", frozenset(), True, where)


_ERROR_RESPONSE = "_create_error_response"


def _handler_outcomes(relative: str, name: str, depth: int = 0) -> list[Outcome]:
    functions = _functions(relative)
    func = functions[name]
    local = _local_assignments(func)
    outcomes: list[Outcome] = []
    for node in _walk_own(func):
        if not isinstance(node, ast.Return):
            continue
        where = f"{relative}:{name}:{node.lineno}"
        value = node.value.value if isinstance(node.value, ast.Await) else node.value
        if value is None:
            outcomes.append(Outcome(frozenset({200}), "null", frozenset(), False, where))
            continue
        if isinstance(value, ast.Call):
            callee = ast.unparse(value.func)
            if callee in ("ORJSONResponse", "orjson_response", "SGLangORJSONResponse", "JSONResponse"):
                content = value.args[0] if value.args else _kw(value, "content")
                status = _status_values(value.args[1] if len(value.args) > 1 else _kw(value, "status_code"), local)
                outcomes.append(_content_outcome(content, status, func, where, local))
                continue
            if callee == "Response":
                content = value.args[0] if value.args else _kw(value, "content")
                status = _status_values(_kw(value, "status_code"), local)
                outcomes.append(Outcome(status, "empty" if content is None else "text", frozenset(), False, where))
                continue
            if callee == "StreamingResponse":
                outcomes.append(Outcome(frozenset({200}), "stream", frozenset(), True, where))
                continue
            if callee == _ERROR_RESPONSE:
                error = _functions(HTTP_SERVER)[_ERROR_RESPONSE]
                outcomes += [dataclasses.replace(o, source=where) for o in _handler_outcomes(HTTP_SERVER, error.name)]
                continue
            if isinstance(value.func, ast.Name) and value.func.id in functions and depth < 4:
                outcomes += _handler_outcomes(relative, value.func.id, depth + 1)
                continue
        outcomes.append(_content_outcome(value, frozenset({200}), func, where, local))
    if _can_complete(func.body):
        outcomes.append(Outcome(frozenset({200}), "null", frozenset(), False, f"{relative}:{name}:end"))
    return outcomes


@functools.cache
def generate_meta_info_fields() -> dict[str, tuple[str, ...]]:
    """``meta_info`` keys of a ``/generate`` answer -> where the source sets them (``file:function``).

    Read from ``tokenizer_manager.py`` (the dict literals bound to ``meta_info``, ``meta_info["k"] =``,
    ``out["meta_info"]["k"] =``, ``meta_info.update({...})`` and ``meta_info.update(<time stats>)``), from
    ``weight_versions.add_weight_versions_to_meta_info`` and from the generated schema
    ``api_types.GenerateMetaInfo``. Most keys are conditional: a finished non-streamed answer always has
    ``id``, ``finish_reason``, ``weight_version``, ``completion_tokens``, ``e2e_latency`` and
    ``response_sent_to_client_ts``; one aborted while still queued (``_handle_abort_req``) has no
    ``prompt_tokens``, ``cached_tokens``, ``reasoning_tokens`` or ``num_retractions``; the logprob keys come
    only with ``return_logprob``.
    """
    out: dict[str, set[str]] = {}

    def note(key: str, where: str) -> None:
        out.setdefault(key, set()).add(where)

    for relative in (TOKENIZER_MANAGER, WEIGHT_VERSIONS):
        for func in _functions(relative).values():
            if not _mentions(relative, func, "meta_info"):
                continue
            where = f"{relative}:{func.name}"
            for node in _walk_own(func):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if (isinstance(target, ast.Name) and target.id == "meta_info"
                                and isinstance(node.value, ast.Dict)):
                            for key in _dict_fields(node.value)[0]:
                                if "." not in key:
                                    note(key, where)
                        if isinstance(target, ast.Subscript) and _str(target.slice) is not None:
                            holder = target.value
                            if ((isinstance(holder, ast.Name) and holder.id == "meta_info")
                                    or (isinstance(holder, ast.Subscript) and _str(holder.slice) == "meta_info")):
                                note(target.slice.value, where)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "update" and ast.unparse(node.func.value) == "meta_info" and node.args):
                    arg = node.args[0]
                    if isinstance(arg, ast.Dict):
                        for key in _dict_fields(arg)[0]:
                            if "." not in key:
                                note(key, where)
                    elif isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) \
                            and arg.func.attr == "convert_to_output_meta_info":
                        for stats in _functions_named(REQ_TIME_STATS, "convert_to_output_meta_info"):
                            for node2 in _walk_own(stats):
                                if isinstance(node2, ast.Assign):
                                    for target in node2.targets:
                                        if isinstance(target, ast.Subscript) and _str(target.slice) is not None:
                                            note(target.slice.value, f"{REQ_TIME_STATS}:convert_to_output_meta_info")
    for field in _struct_fields(API_TYPES, "GenerateMetaInfo"):
        note(field, f"{API_TYPES}:GenerateMetaInfo")
    if not {"id", "finish_reason", "output_token_logprobs", "weight_version"} <= set(out):
        raise SGLangSourceError(f"could not read /generate's meta_info keys from {source_path(TOKENIZER_MANAGER)}")
    return {key: tuple(sorted(where)) for key, where in sorted(out.items())}


def api_schema_fields(name: str) -> dict[str, str]:
    """Field -> annotation text of ``sglang.api.v1.<name>`` (the generated JSON schema, ``api/v1/api_types.py``).

    ``/generate`` bodies are checked against ``GenerateRequest`` after FastAPI's own parse
    (``http_server.generate_request`` -> ``api_contract.generate_contract_error``): a violation is a 400
    ``{"error": "<text>"}``. See :func:`api_schema_rejects_unknown` for which objects refuse unknown keys.
    """
    cls = _classes(API_TYPES).get(name)
    if cls is None:
        raise KeyError(f"sglang {sglang_version()} has no schema type {name!r} in {source_path(API_TYPES)}")
    return {node.target.id: ast.unparse(node.annotation) for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}


def api_schema_rejects_unknown(name: str) -> bool:
    """Whether the generated decoder of ``sglang.api.v1.<name>`` refuses unknown keys (its docstring says so).

    ``GenerateRequest`` ignores them; ``SamplingParams`` rejects them, so every key of a ``/generate``
    ``sampling_params`` must be one of :func:`api_schema_fields` ``("SamplingParams")``.
    """
    api_schema_fields(name)
    doc = ast.get_docstring(_classes(API_TYPES)[name]) or ""
    if "unknown keys rejected" in doc:
        return True
    if "unknown keys ignored" in doc:
        return False
    raise SGLangSourceError(f"{API_TYPES}:{name}: its docstring does not say whether unknown keys are rejected")


def _functions_named(relative: str, name: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [node for node in ast.walk(_tree(relative))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name]


def _struct_fields(relative: str, name: str) -> list[str]:
    cls = _classes(relative).get(name)
    if cls is None:
        raise SGLangSourceError(f"no class {name} in {source_path(relative)}")
    return [node.target.id for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)]


@functools.cache
def load_fields() -> tuple[frozenset[str], frozenset[str]]:
    """The fields of one ``/v1/loads`` entry (``LoadSnapshot``, one per DP rank) and of its ``queues``
    (``QueueMetrics``)."""
    return (frozenset(_struct_fields(LOAD_SNAPSHOT, "LoadSnapshot")),
            frozenset(_struct_fields(LOAD_SNAPSHOT, "QueueMetrics")))


@functools.cache
def generate_response_fields() -> dict[str, tuple[str, ...]]:
    """Top-level keys of one ``/generate`` answer (one per input) -> where they are set.

    The dict literals holding a ``"meta_info"`` key in ``tokenizer_manager.py`` (``_handle_batch_output``,
    ``_handle_abort_req``), the keys later assigned into them (``out_dict["prompt_token_ids"]``,
    ``result["index"]`` for batches) and ``api_types.GenerateResponse``.
    """
    out: dict[str, set[str]] = {}
    for func in _functions(TOKENIZER_MANAGER).values():
        if not _mentions(TOKENIZER_MANAGER, func, "meta_info"):
            continue
        where = f"{TOKENIZER_MANAGER}:{func.name}"
        holders = set()
        for node in _walk_own(func):
            if isinstance(node, ast.Dict) and "meta_info" in {_str(key) for key in node.keys}:
                for key in _dict_fields(node)[0]:
                    if "." not in key:
                        out.setdefault(key, set()).add(where)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                    and "meta_info" in {_str(key) for key in node.value.keys}:
                holders |= {target.id for target in node.targets if isinstance(target, ast.Name)}
            if isinstance(node, ast.Subscript) and _str(node.slice) == "meta_info" and isinstance(node.value, ast.Name):
                holders.add(node.value.id)
        for holder in holders:
            for key in _subscript_keys(func, holder):
                out.setdefault(key, set()).add(where)
    for field in _struct_fields(API_TYPES, "GenerateResponse"):
        out.setdefault(field, set()).add(f"{API_TYPES}:GenerateResponse")
    if not {"output_ids", "meta_info"} <= set(out):
        raise SGLangSourceError(f"could not read /generate's answer keys from {source_path(TOKENIZER_MANAGER)}")
    return {key: tuple(sorted(where)) for key, where in sorted(out.items())}


@functools.cache
def finish_reasons() -> dict[str, frozenset[str]]:
    """``meta_info.finish_reason`` shapes: its ``type`` -> the keys of that dict.

    From the ``to_json`` of the ``FINISH_*`` classes in ``schedule_batch.py`` and the abort dict
    ``tokenizer_manager._handle_abort_req`` builds for requests aborted while queued.
    """
    out: dict[str, set[str]] = {}
    dicts = []
    for cls in _classes(SCHEDULE_BATCH).values():
        if cls.name.startswith("FINISH_"):
            dicts += [node for node in ast.walk(cls) if isinstance(node, ast.Dict)]
    abort = _functions(TOKENIZER_MANAGER).get("_handle_abort_req")
    if abort is not None:
        dicts += [node for node in ast.walk(abort) if isinstance(node, ast.Dict)]
    for node in dicts:
        keys = {_str(key): value for key, value in zip(node.keys, node.values)}
        kind = _str(keys.get("type"))
        if kind is not None:
            out.setdefault(kind, set()).update(key for key in keys if key is not None)
    if not {"stop", "length", "abort"} <= set(out):
        raise SGLangSourceError(f"could not read the finish reasons from {source_path(SCHEDULE_BATCH)}")
    return {kind: frozenset(keys) for kind, keys in out.items()}


def _tokenizer_body(handler: str) -> Outcome | None:
    """The body of routes whose handler returns what the tokenizer manager built (opaque in http_server.py)."""
    if handler == "serve_generate_request":
        fields = set(generate_response_fields())
        fields |= {f"meta_info.{key}" for key in generate_meta_info_fields()}
        fields |= {f"meta_info.finish_reason.{key}" for keys in finish_reasons().values() for key in keys}
        return Outcome(frozenset({200}), "object", frozenset(fields), True,
                       f"{TOKENIZER_MANAGER}:_handle_batch_output,_handle_abort_req")
    if handler == "get_weights_by_name":
        func = _functions(TOKENIZER_CONTROL).get("get_weights_by_name")
        if func is None:
            raise SGLangSourceError(f"no get_weights_by_name in {source_path(TOKENIZER_CONTROL)}")
        return Outcome(frozenset({200}), "list", frozenset(), False,
                       f"{TOKENIZER_CONTROL}:get_weights_by_name:{func.lineno} (GetWeightsByNameReqOutput.parameter)")
    return None


@functools.cache
def route_responses(path: str) -> tuple[Outcome, ...]:
    """Every answer the handler of ``path`` can give, as far as the source shows it.

    Request bodies FastAPI cannot validate (a missing required field, a wrong type, no body for a
    handler that takes one) are answered by ``validation_exception_handler`` with a 400
    ``{"object", "message", "type", "param", "code"}``: :func:`validation_error_fields`.
    """
    found = route(path)
    out = []
    for outcome in _handler_outcomes(found.source.rsplit(":", 1)[0], found.handler):
        if outcome.body == "opaque":
            replaced = _tokenizer_body(outcome.source.split(":")[1])
            if replaced is not None:
                outcome = dataclasses.replace(replaced, status=outcome.status)
        out.append(outcome)
    return tuple(out)


def validation_error_fields() -> frozenset[str]:
    """Keys of the 400 answer to a request body FastAPI cannot validate (``ErrorResponse`` of the OpenAI protocol)."""
    return frozenset(_struct_fields("srt/entrypoints/openai/protocol.py", "ErrorResponse"))


def response_fields(path: str, status: int = 200) -> frozenset[str]:
    """The JSON object keys (dotted for nested ones) ``path`` answers with ``status``."""
    fields: set[str] = set()
    for outcome in route_responses(path):
        if outcome.body == "object" and (outcome.status is None or status in outcome.status):
            fields |= outcome.fields
    return frozenset(fields)


def returns_field(path: str, field: str, status: int = 200) -> bool:
    """Whether SGLang's answer to ``path`` with ``status`` can hold ``field`` (dotted for nested: ``meta_info.id``)."""
    return field in response_fields(path, status)


def response_statuses(path: str) -> frozenset[int]:
    """The HTTP status codes the handler of ``path`` answers with (a 400 for an invalid body comes on top)."""
    statuses: set[int] = set()
    for outcome in route_responses(path):
        if outcome.status is not None:
            statuses |= outcome.status
    return frozenset(statuses)


# --------------------------------------------------------------------------------------------
# ServerArgs and the launch_server command line
# --------------------------------------------------------------------------------------------


@functools.cache
def _server_args() -> tuple[tuple[tuple[str, str, dict[str, Any] | None], ...], tuple[tuple[str, str], ...]]:
    """((field, type text, Arg metadata or None if no CLI), ...), ((flag, dest), ...) of the installed ServerArgs."""
    tree = _tree(SERVER_ARGS)
    imports = _imports(tree)
    namespaces = None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES"
                                                 for t in node.targets)):
            namespaces = [elt.id for elt in node.value.elts]
    server_args = _classes(SERVER_ARGS).get("ServerArgs")
    if namespaces is None or server_args is None:
        raise SGLangSourceError(f"{source_path(SERVER_ARGS)} has no ServerArgs class or _INPUT_NAMESPACES list")
    classes: list[tuple[str, ast.ClassDef]] = []
    for name in namespaces:
        if name not in imports:
            raise SGLangSourceError(f"{SERVER_ARGS}: ServerArgs namespace {name} is not imported from an sglang module")
        relative = _module_file(imports[name][0])
        cls = _classes(relative).get(imports[name][1])
        if cls is None:
            raise SGLangSourceError(f"no class {imports[name][1]} in {source_path(relative)}")
        classes.append((relative, cls))
    classes.append((SERVER_ARGS, server_args))

    fields = []
    flags = []
    for relative, cls in classes:
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            annotation = node.annotation
            if ast.unparse(annotation).startswith(("ClassVar", "typing.ClassVar")):
                continue
            name = node.target.id
            arg = None
            if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("A", "Annotated"):
                elts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
                for meta in elts[1:]:
                    if _str(meta) is not None or isinstance(meta, ast.JoinedStr):
                        arg = {}
                        break
                    if isinstance(meta, ast.Call) and ast.unparse(meta.func) == "Arg":
                        arg = {}
                        for keyword in meta.keywords:
                            if keyword.arg in ("cli_name", "aliases", "no_cli"):
                                try:
                                    arg[keyword.arg] = ast.literal_eval(keyword.value)
                                except ValueError as exc:
                                    raise SGLangSourceError(
                                        f"{relative}:{node.lineno}: {name}: Arg({keyword.arg}="
                                        f"{ast.unparse(keyword.value)}) is not a literal") from exc
                            elif keyword.arg == "action":
                                arg["action"] = ast.unparse(keyword.value)
                        break
            fields.append((name, ast.unparse(_unwrap_annotated(annotation)), arg))
            if arg is not None and not arg.get("no_cli"):
                cli_name = arg.get("cli_name") or "--" + name.replace("_", "-")
                options = [cli_name] + list(arg.get("aliases") or [])
                if arg.get("action", "").endswith("BooleanOptionalAction"):  # argparse adds --no-<flag>
                    options += ["--no-" + option[2:] for option in options if option.startswith("--")]
                flags += [(option, name) for option in options]
    add_cli_args = next((node for node in server_args.body
                         if isinstance(node, ast.FunctionDef) and node.name == "add_cli_args"), None)
    if add_cli_args is None:
        raise SGLangSourceError(f"{source_path(SERVER_ARGS)}: ServerArgs has no add_cli_args")
    for node in ast.walk(add_cli_args):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            options = [_str(arg) for arg in node.args]
            if None in options:
                raise SGLangSourceError(f"{SERVER_ARGS}:{node.lineno}: add_argument with a non-literal option")
            dest = _str(_kw(node, "dest")) or options[0].lstrip("-").replace("-", "_")
            if ast.unparse(_kw(node, "action") or ast.Constant(None)).endswith("BooleanOptionalAction"):
                options += ["--no-" + option[2:] for option in options if option.startswith("--")]
            flags += [(option, dest) for option in options]
    return tuple(fields), tuple(flags)


def server_args_fields() -> dict[str, str]:
    """``ServerArgs`` field -> its type's source text (the ``T`` of ``A[T, ...]``), across all its namespaces."""
    return {name: annotation for name, annotation, _ in _server_args()[0]}


def launch_server_flags() -> dict[str, str]:
    """Every option string ``python -m sglang.launch_server`` accepts -> the ``ServerArgs`` field it sets."""
    return dict(_server_args()[1])


def cli_flag(field: str) -> str:
    """The canonical ``--flag`` of ``ServerArgs.<field>``; KeyError if the field has no CLI flag."""
    for name, _, arg in _server_args()[0]:
        if name == field:
            if arg is None or arg.get("no_cli"):
                raise KeyError(f"ServerArgs.{field} has no launch_server flag in sglang {sglang_version()}")
            return arg.get("cli_name") or "--" + field.replace("_", "-")
    raise KeyError(f"ServerArgs has no field {field!r} in sglang {sglang_version()}")


def clear_cache() -> None:
    """Forget what was read (the package location and parsed files), e.g. after sglang was reinstalled."""
    for cached in (sglang_root, _tree, _lines, _functions, _classes, _all_routes, _record_fields, route_responses,
                   _server_args, generate_meta_info_fields, generate_response_fields, finish_reasons):
        cached.cache_clear()
