"""The package's shape, read from its source with `ast` (nothing is imported): no import cycle,
engine/ importing nothing of megatrain_jax outside itself, no module standing on one above it
(FORBIDDEN), one table of device peaks (scripts read megatrain_jax.machines'), short
functions in the modules around the engine (issue 26), a step that reads only what it is
given (issue 36) and asks the host only through its protocol, scripts that read the engine
through its public API, and one module that writes bus copies (issue 47)."""

import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "megatrain_jax"
ENGINE = f"{PACKAGE}.engine"
MAX_FUNCTION_LINES = 60
SHORT_MODULES = ("train.py", "config.py", "plan.py", "engine/step.py")
# the step, the evaluation and the first stage's ways: they read their StepParts, not the engine
STEP_MODULES = ("engine/step.py", "engine/evaluate.py", "engine/lookup.py")


def module_sources(root: pathlib.Path = ROOT, package: str = PACKAGE) -> dict:
    """{dotted module name: source} of every .py file of the package (a package is its
    __init__.py)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path.read_text()
    return out


def import_graph(sources: dict, package: str = PACKAGE) -> dict:
    """{module: set of the package's modules it imports}, counting every import statement at any
    depth (a lazy import inside a function is still an edge): `import p.x`, `from p.x import y`
    (an edge to p.x.y when that is a module, else to p.x) and relative imports."""
    packages = {m for m, s in sources.items() if m == package or any(
        k.startswith(m + ".") for k in sources)}

    def known(name: str) -> str | None:  # the longest prefix of name that is a module
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in sources:
                return ".".join(parts[:i])
        return None

    graph = {}
    for module, source in sources.items():
        here = module if module in packages else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == package]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here.split(".")[:len(here.split(".")) - node.level + 1])
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                if base.split(".")[0] != package:
                    continue
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base
                           for a in node.names]
            else:
                continue
            edges |= {t for t in map(known, targets) if t is not None and t != module}
        graph[module] = edges
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan), each a sorted list."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_cycle_finder_sees_lazy_submodule_and_relative_imports(tmp_path):
    """The checks below can fail: a cycle through a function's import, through `from p.x import
    y` where p.x.y is a module (an edge to p.x.y, not to the package p.x), and through a relative
    import is found; an import without a way back (p.d) is no cycle."""
    files = {"p/__init__.py": "",
             "p/a.py": "def f():\n    from p.sub import b\n",
             "p/sub/__init__.py": "import p.c\n",
             "p/sub/b.py": "from .. import a\n",
             "p/c.py": "from p import sub\n",
             "p/d.py": "import p.a\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(module_sources(tmp_path, "p"), "p")
    assert graph["p.a"] == {"p.sub.b"}
    assert graph["p.sub.b"] == {"p.a"}
    assert cycles(graph) == [["p.a", "p.sub.b"], ["p.c", "p.sub"]]


def reaches(graph: dict, module: str) -> set:
    """Every module `module` imports, directly or through others."""
    seen, todo = set(), [module]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def under(module: str, name: str) -> bool:
    """module is name or a module of the package name."""
    return module == name or module.startswith(name + ".")


# Arrows that must not exist, directly or through other modules (issue 36 item 5): a module low
# in the stack does not stand on one above it.
DATA_STACK = ("recipes", "data", "sources", "chat", "preference", "dpo", "hf")
FORBIDDEN = [
    # the FLOP and parameter counts stand near the ground: what a run builds is passed in
    *[("flops", above) for above in DATA_STACK],
    ("config", "chat"),  # the config names data.overlong's choices itself
    ("config", "hf"),  # model.from_hf is read by recipes.load_config
    ("engine.decode", "engine.streamed"),  # the decoder shares helpers, not the trainer's class
]


def forbidden_arrows(graph: dict, package: str = PACKAGE) -> list:
    """[(importer, imported module)] of every FORBIDDEN arrow found in graph."""
    return [(importer, target) for importer, above in FORBIDDEN
            for target in sorted(reaches(graph, f"{package}.{importer}"))
            if under(target, f"{package}.{above}")]


def test_the_layering_check_sees_an_arrow_through_another_module_and_a_lazy_import(tmp_path):
    """Each arrow fails the check, also when it goes through a module between or sits inside a
    function, and a module of a forbidden package counts as that package."""
    files = {"p/__init__.py": "", "p/hf/__init__.py": "", "p/hf/io.py": "",
             "p/model.py": "def f():\n    from p.hf import io\n",
             "p/config.py": "from p import model\n",
             "p/flops.py": "import p.recipes\n", "p/recipes.py": "",
             "p/engine/__init__.py": "", "p/engine/streamed.py": "",
             "p/engine/decode.py": "from .streamed import x\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(module_sources(tmp_path, "p"), "p")
    assert forbidden_arrows(graph, "p") == [("flops", "p.recipes"), ("config", "p.hf.io"),
                                            ("engine.decode", "p.engine.streamed")]


def test_no_module_stands_on_one_above_it():
    assert forbidden_arrows(import_graph(module_sources())) == []


def test_no_import_cycle_in_the_package():
    assert cycles(import_graph(module_sources())) == []


def test_the_engine_imports_nothing_of_the_package_outside_itself():
    graph = import_graph(module_sources())
    outside = {m: sorted(t for t in targets if t != ENGINE and not t.startswith(ENGINE + "."))
               for m, targets in graph.items() if m == ENGINE or m.startswith(ENGINE + ".")}
    assert {m: t for m, t in outside.items() if t} == {}


def name_reads(source: str, attr: str, owner=None) -> list:
    """Line numbers where source reads attribute `attr` of a name that `owner` accepts (None:
    of any name, or `attr` named alone); docstrings and comments aside."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Attribute) and node.attr == attr
                   and isinstance(node.value, ast.Name)
                   and (owner is None or owner(node.value.id))
                   or owner is None and isinstance(node, ast.Name) and node.id == attr})


def test_name_reads_sees_code_not_text():
    source = ('"""engine.host.bus"""\nx = engine.host.bus(1)\n# engine.host\n'
              'y = engine.host_update\nz = jit_engine.host\nn = sys.getrefcount(x)\n'
              'm = getrefcount(x)\nhost = 1\n')
    assert name_reads(source, "host", lambda name: name.endswith("engine")) == [2, 5]
    assert name_reads(source, "getrefcount") == [6, 7]


def test_scripts_read_the_engine_through_its_public_api():
    """No script reaches into an engine's host state (`engine.host`, the engine's internals,
    which its own tests may read): each figure a benchmark reads is a public property, method,
    counter or hook of StreamedEngine (docs/engine-api.md). And no module of the package judges
    who reads the state by sys.getrefcount: readers hold leases (engine/store.py)."""
    scripts = {path.name: name_reads(path.read_text(), "host", lambda n: n.endswith("engine"))
               for path in sorted((ROOT / "scripts").glob("*.py"))}
    assert {name: lines for name, lines in scripts.items() if lines} == {}
    counts = {module: name_reads(source, "getrefcount")
              for module, source in module_sources().items()}
    assert {module: lines for module, lines in counts.items() if lines} == {}


# What writes a bus copy: making or refreshing one (bus.refresh), taking its raw pointers to write
# it in place (packing's `targets`, the kernel's and the ring's casts), casting into them, or
# setting a unit's or a ring slot's `bus`/`spare` (another object's: StreamedEngine's own
# `self.bus` names its bus form)
BUS_WRITE_CALLS = ("refresh", "targets", "cast_into")
BUS_FIELDS = ("bus", "spare")
BUS_WRITER = f"{ENGINE}.bus"


def bus_writes(source: str) -> list:
    """Line numbers of source's writes of a bus copy (BUS_WRITE_CALLS, BUS_FIELDS)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in BUS_WRITE_CALLS:
                lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and node.attr in BUS_FIELDS
              and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_bus_write_check_sees_calls_and_fields_not_text():
    source = ('"""unit.bus = x"""\nunit.bus = make()\nslot.bus, slot.fetches = a, []\n'
              'self.bus = form\nout = packing.targets(bus, "")\n# refresh(x)\ny = refresh(x)\n'
              'cast_into(t, m)\nunit.spare = None\nz = unit.bus\nw = self.refreshed(x)\n')
    assert bus_writes(source) == [2, 3, 5, 7, 8, 9]


def test_one_module_writes_bus_copies():
    """bus.py is the one writer of every bus copy (issue 47 item 1): made, filled, written in
    place by the direct kernel (through the targets bus.py hands it) or the ring, refreshed,
    released. packing.py defines `targets` and calls none."""
    writes = {module: bus_writes(source) for module, source in module_sources().items()
              if module.startswith(ENGINE)}
    assert {module: lines for module, lines in writes.items() if lines} == {
        BUS_WRITER: writes[BUS_WRITER]}
    assert writes[BUS_WRITER]


# What a branch on the update path or the bus form reads (update.py's and bus.py's own words)
MODE_WORDS = {"direct", "kind", "in_place", "in_ring", "ring", "form", "is_params", "on_host",
              "RING", "RESIDENT", "prepare_first"}
MAX_COORDINATOR_LINES = 250


def mode_branches(source: str, name: str) -> list:
    """Line numbers of class `name`'s conditions (if, a conditional expression, a comprehension's
    if, while) that read one of MODE_WORDS, as a name or an attribute."""
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)
               and n.name == name)
    tests = [n.test for n in ast.walk(cls) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [t for n in ast.walk(cls) if isinstance(n, ast.comprehension) for t in n.ifs]
    return sorted({t.lineno for t in tests for n in ast.walk(t)
                   if isinstance(n, ast.Attribute) and n.attr in MODE_WORDS
                   or isinstance(n, ast.Name) and n.id in MODE_WORDS})


def test_the_mode_branch_check_sees_conditions_not_calls():
    source = ("class H:\n    def f(self):\n        self.update.apply(1)\n"
              "        if self.update.kind == 'direct':\n            pass\n"
              "        x = 1 if self.buses.in_ring(2) else 0\n"
              "        return [u for u in self.units if u.ready]\n")
    assert mode_branches(source, "H") == [4, 6]


def test_the_host_state_coordinates_and_branches_on_no_mode():
    """HostState holds the thread, the futures, the units' order and failures (issue 47 item 1):
    at most MAX_COORDINATOR_LINES lines, no condition on the update path or the bus form (those
    are update.py's and bus.py's)."""
    source = (ROOT / PACKAGE / "engine/host.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)
               and n.name == "HostState")
    assert cls.end_lineno - cls.lineno + 1 <= MAX_COORDINATOR_LINES
    assert mode_branches(source, "HostState") == []


def test_data_stands_below_the_sources_package():
    """data.py (tokenizers, one file's tokens, document masks, windows and batches) is the layer
    the sources package (paths of many files, token caches, mixtures, reading ahead) builds on:
    nothing data.py imports, directly or through another module, is of sources/."""
    sources = f"{PACKAGE}.sources"
    found = reaches(import_graph(module_sources()), f"{PACKAGE}.data")
    assert sorted(m for m in found if m == sources or m.startswith(sources + ".")) == []


def peak_tables(source: str, kinds: set) -> list:
    """Line numbers of literal (device kind, number) pairs naming a kind of kinds."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Tuple) and len(node.elts) == 2
            and all(isinstance(e, ast.Constant) for e in node.elts)
            and node.elts[0].value in kinds and isinstance(node.elts[1].value, (int, float))]


def test_the_scripts_read_the_one_table_of_device_peaks():
    """The datasheet peaks live in megatrain_jax.machines.PEAK_BF16_TFLOPS: no script or other
    module holds its own (bench.py had 989.4 where plan.py had 989)."""
    plan_source = (ROOT / PACKAGE / "machines.py").read_text()
    table = next(n.value for n in ast.walk(ast.parse(plan_source)) if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "PEAK_BF16_TFLOPS" for t in n.targets))
    kinds = {ast.literal_eval(pair)[0] for pair in table.elts}
    assert "H100" in kinds and peak_tables(plan_source, kinds)
    files = [*(ROOT / "scripts").glob("*.py"), *(ROOT / PACKAGE).rglob("*.py")]
    found = {str(p.relative_to(ROOT)): peak_tables(p.read_text(), kinds) for p in files
             if p != ROOT / PACKAGE / "machines.py"}
    assert {p: lines for p, lines in found.items() if lines} == {}


def longest_function(source: str) -> tuple:
    """(lines, name) of the longest function or method in source, nested ones included."""
    return max(((node.end_lineno - node.lineno + 1, node.name)
                for node in ast.walk(ast.parse(source))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))), default=(0, ""))


def test_longest_function_measures_lines():
    source = "def f():\n    x = 1\n\n    return x\n\n\ndef g():\n    pass\n"
    assert longest_function(source) == (4, "f")


def test_functions_of_the_modules_around_the_engine_are_short():
    lengths = {name: longest_function((ROOT / PACKAGE / name).read_text())
               for name in SHORT_MODULES}
    assert {n: v for n, v in lengths.items() if v[0] >= MAX_FUNCTION_LINES} == {}


def engine_reads(source: str) -> list:
    """Line numbers where source names `engine` (a variable, a parameter or an attribute read
    off one), docstrings and comments aside."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source))
                   if isinstance(node, ast.Name) and node.id == "engine"
                   or isinstance(node, ast.arg) and node.arg == "engine"})


def test_engine_reads_sees_a_parameter_and_an_attribute_read():
    source = ('"""the engine"""\ndef run(engine, x):\n    # engine\n    return x\n\n\n'
              'def f(sp):\n    return g(sp).engine.host\n\n\ndef h(e=engine):\n    pass\n')
    assert engine_reads(source) == [2, 11]


def run_parameters(source: str, name: str) -> list:
    """(name, annotation) of each parameter of the top-level function `name`."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
              and n.name == name)
    return [(a.arg, a.annotation and ast.unparse(a.annotation)) for a in fn.args.args]


def test_the_step_reads_what_it_is_given_not_the_engine():
    """step.run (and the evaluation's run and outputs) take the step's parts (step.StepParts),
    which StreamedEngine builds, instead of reading the engine's attributes and writing one
    back; nothing in the step's modules names the engine."""
    found = {name: engine_reads((ROOT / PACKAGE / name).read_text()) for name in STEP_MODULES}
    assert {n: lines for n, lines in found.items() if lines} == {}
    step = (ROOT / PACKAGE / "engine/step.py").read_text()
    evaluate = (ROOT / PACKAGE / "engine/evaluate.py").read_text()
    assert run_parameters(step, "run")[0] == ("sp", "StepParts")
    assert run_parameters(evaluate, "run")[0] == ("sp", "StepParts")
    assert run_parameters(evaluate, "outputs")[0] == ("sp", "StepParts")


# The modules that make the host state: the step's modules name none of them, only the interface
# the step asks of it (engine/step_host.py's StepHost), which HostState satisfies
HOST_SIDE = ("host", "bus", "direct", "update", "store", "tier", "fused_adamw")
HOST_PROTOCOL = ("engine/step_host.py", "StepHost")


def class_members(source: str, name: str) -> set:
    """The members class `name` of source declares (annotated fields, methods) or sets on self."""
    cls = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)
               and n.name == name)
    members = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    members |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    return members | {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                      and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                      and n.value.id == "self"}


def host_reads(source: str) -> set:
    """The attributes source reads off a host state: off a name `host` or an attribute `.host`
    (sp.host.bus, host.last)."""
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and (isinstance(node.value, ast.Name) and node.value.id == "host"
                 or isinstance(node.value, ast.Attribute) and node.value.attr == "host")}


def object_fields(source: str) -> list:
    """`Class.field` of every class field of source annotated `object`."""
    return [f"{cls.name}.{n.target.id}" for cls in ast.walk(ast.parse(source))
            if isinstance(cls, ast.ClassDef) for n in cls.body
            if isinstance(n, ast.AnnAssign) and ast.unparse(n.annotation) == "object"]


def test_the_host_checks_read_code():
    source = ("class P:\n    a: int\n    b: object\n    def f(self):\n        self.c = 1\n"
              "        self.d.e = 2\n\n\ndef g(sp, host):\n    return sp.host.x(host.y, z.w)\n")
    assert class_members(source, "P") == {"a", "b", "f", "c"}
    assert host_reads(source) == {"x", "y"}
    assert object_fields(source) == ["P.b"]


def test_the_step_asks_the_host_only_through_its_protocol():
    """step, lookup and evaluate import nothing of the host side but the protocol (issue 47
    item 3): what they read of the host is exactly StepHost's members, every one of which
    HostState has; and no field of theirs is typed `object`."""
    graph = import_graph(module_sources())
    module = lambda path: f"{PACKAGE}.{path.removesuffix('.py').replace('/', '.')}"
    host_side = {f"{ENGINE}.{name}" for name in HOST_SIDE}
    imported = {name: sorted(graph[module(name)] & host_side) for name in STEP_MODULES}
    assert {name: found for name, found in imported.items() if found} == {}
    assert {name: module(HOST_PROTOCOL[0]) in graph[module(name)]
            for name in ("engine/step.py", "engine/lookup.py")} == {
        "engine/step.py": True, "engine/lookup.py": True}
    protocol = class_members((ROOT / PACKAGE / HOST_PROTOCOL[0]).read_text(), HOST_PROTOCOL[1])
    read = set().union(*(host_reads((ROOT / PACKAGE / name).read_text())
                         for name in STEP_MODULES))
    assert read == protocol
    host_state = class_members((ROOT / PACKAGE / "engine/host.py").read_text(), "HostState")
    assert sorted(protocol - host_state) == []
    typed = {name: object_fields((ROOT / PACKAGE / name).read_text()) for name in STEP_MODULES}
    assert {name: fields for name, fields in typed.items() if fields} == {}
    step = (ROOT / PACKAGE / "engine/step.py").read_text()
    host_field = next(n for n in ast.walk(ast.parse(step)) if isinstance(n, ast.AnnAssign)
                      and n.target.id == "host")
    assert ast.unparse(host_field.annotation) == HOST_PROTOCOL[1]


# The engine's choice lists (issue 47 item 6), each spelled out once where its concept lives:
# the copies' forms (schedule.EAGER, JIT; transfer.COPIES adds auto), the bus forms (bus.RESIDENT,
# RING; bus.FORMS adds auto), the host updates (update.HOST_UPDATES)
CHOICE_WORDS = ({"auto", "eager", "jit"}, {"auto", "resident", "ring"}, {"auto", "direct", "jit"})
CHOICE_HOMES = {"megatrain_jax/engine/schedule.py", "megatrain_jax/engine/bus.py",
                "megatrain_jax/engine/update.py"}
# config.py's names for the engine's lists: imported, never its own
CONFIG_IMPORTS = {"COPIES": (f"{ENGINE}.transfer", "COPIES"),
                  "BUS_FORMS": (f"{ENGINE}.bus", "FORMS"),
                  "STATE_DTYPES": (f"{ENGINE}.fused_adamw", "STATE_DTYPES")}


def choice_literals(source: str) -> list:
    """Line numbers of source's tuple, list or set literals of two or more strings, all words of
    one of CHOICE_WORDS's lists (a choice list spelled out)."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2
                  and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                          for e in node.elts)
                  and any({e.value for e in node.elts} <= words for words in CHOICE_WORDS))


def config_names(source: str) -> dict:
    """{name: (module, name) it is imported from, or None where config.py assigns it}."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            out.update({a.asname or a.name: (node.module, a.name) for a in node.names})
        elif isinstance(node, ast.Assign):
            out.update({t.id: None for t in node.targets if isinstance(t, ast.Name)})
    return out


def test_the_choice_list_check_sees_literals_and_imports_not_text():
    source = ('"""("eager", "jit")"""\nA = ("auto", "eager", "jit")\nB = ["resident", "ring"]\n'
              'C = ("auto", "x")\nD = ("eager", JIT)\nE = "eager" in {"jit", "eager"}\n'
              'from m import F as COPIES\nSTATE_DTYPES = 1\n')
    assert choice_literals(source) == [2, 3, 6]
    names = config_names(source)
    assert (names["COPIES"], names["STATE_DTYPES"]) == (("m", "F"), None)


def test_each_choice_list_is_spelled_out_once():
    """The copies' forms, the bus forms and the host updates are written out only where they
    live (the engine's schedule, bus and update modules), nowhere else in the package or the
    scripts; config.py validates with the engine's own lists (imported, so a new form is one
    edit), and the engine never imports config."""
    found = {str(path.relative_to(ROOT)): choice_literals(path.read_text())
             for folder in (PACKAGE, "scripts") for path in sorted((ROOT / folder).rglob("*.py"))}
    found = {path: lines for path, lines in found.items() if lines}
    assert sorted(found) == sorted(CHOICE_HOMES)
    assert all(len(lines) == 1 for lines in found.values()), found
    names = config_names((ROOT / PACKAGE / "config.py").read_text())
    assert {name: names.get(name) for name in CONFIG_IMPORTS} == CONFIG_IMPORTS
