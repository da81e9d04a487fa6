"""dtrain's C++ rules: cc_library, cc_test and cc_binary with the LibTorch headers precompiled.

<ATen/ATen.h> and <torch/nn/module.h> take 14 s and 21 s to parse on a two-core machine, and
nearly every translation unit includes them. `torch_pch` precompiles them once per build
configuration (ci, asan, a user's workspace), with the flags of that configuration, and the
macros below pass `-include bazel/pch/torch.h` to every target that uses LibTorch. GCC takes
the precompiled copy next to that header when it was made with the same flags (the `pic` one
for position-independent objects, the `nopic` one, made under -c opt only, for the rest) and
parses the header text otherwise, so a mismatch costs time, never correctness. `--define=dtrain_pch=off` leaves the
precompiled header out (a compiler other than GCC). The CMake build does the same with
target_precompile_headers (CMakeLists.txt, DTRAIN_PCH).
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load("@bazel_tools//tools/build_defs/cc:action_names.bzl", "ACTION_NAMES")

_HEADERS = ["ATen/ATen.h", "torch/nn/module.h"]

def _torch_pch_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    features = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    dep = cc_common.merge_cc_infos(cc_infos = [d[CcInfo] for d in ctx.attr.deps])
    deps_cc = dep.compilation_context
    header = ctx.actions.declare_file("pch/torch.h")
    ctx.actions.write(header, "".join(["#include <%s>\n" % h for h in _HEADERS]))
    compiler = cc_common.get_tool_for_action(
        feature_configuration = features,
        action_name = ACTION_NAMES.cpp_compile,
    )
    outputs = []

    # Bazel compiles position-independent objects only, binaries' too, unless the compilation
    # mode is opt (where binaries get non-PIC objects): the unused copy would cost 40 s.
    for pic in ([True, False] if ctx.var["COMPILATION_MODE"] == "opt" else [True]):
        gch = ctx.actions.declare_file("pch/torch.h.gch/%s" % ("pic" if pic else "nopic"))
        variables = cc_common.create_compile_variables(
            feature_configuration = features,
            cc_toolchain = cc_toolchain,
            user_compile_flags = ctx.fragments.cpp.copts + ctx.fragments.cpp.cxxopts +
                                 ["-x", "c++-header"],
            source_file = header.path,
            output_file = gch.path,
            include_directories = deps_cc.includes,
            quote_include_directories = deps_cc.quote_includes,
            system_include_directories = deps_cc.system_includes,
            preprocessor_defines = deps_cc.defines,
            use_pic = pic,
        )
        ctx.actions.run(
            executable = compiler,
            arguments = cc_common.get_memory_inefficient_command_line(
                feature_configuration = features,
                action_name = ACTION_NAMES.cpp_compile,
                variables = variables,
            ),
            env = cc_common.get_environment_variables(
                feature_configuration = features,
                action_name = ACTION_NAMES.cpp_compile,
                variables = variables,
            ),
            inputs = depset([header], transitive = [deps_cc.headers, cc_toolchain.all_files]),
            outputs = [gch],
            mnemonic = "TorchPch",
            progress_message = "Precompiling the LibTorch headers (%s)" % ("pic" if pic else "nopic"),
        )
        outputs.append(gch)
    own = cc_common.create_compilation_context(headers = depset([header] + outputs))
    return [
        DefaultInfo(files = depset([header] + outputs)),
        cc_common.merge_cc_infos(
            direct_cc_infos = [CcInfo(compilation_context = own)],
            cc_infos = [dep],
        ),
    ]

torch_pch = rule(
    implementation = _torch_pch_impl,
    attrs = {
        "deps": attr.label_list(providers = [CcInfo]),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
    incompatible_use_toolchain_transition = True,
)

# Labels whose code never sees LibTorch: their dependents get no precompiled header unless
# they name LibTorch themselves.
_TORCH_FREE = ["//comm:backend", "//core", "//launcher", "//third_party", "//tests:flags"]

def _uses_torch(deps):
    if type(deps) != "list":
        return True  # a select(): the comm backends, which use LibTorch
    for d in deps:
        if d == "@libtorch//:torch":
            return True
        label = d if not d.startswith(":") else "//%s%s" % (native.package_name(), d)
        if not [p for p in _TORCH_FREE if label == p or label.startswith(p + ":") or label.startswith(p + "/")]:
            return True
    return False

def _with_pch(kwargs):
    deps = kwargs.get("deps", [])
    if not kwargs.get("srcs") or not _uses_torch(deps):
        return kwargs
    kwargs = dict(kwargs)
    kwargs["deps"] = deps + ["//bazel:torch_pch"]
    kwargs["copts"] = kwargs.get("copts", []) + select({
        "//bazel:no_pch": [],
        "//conditions:default": ["-include", "bazel/pch/torch.h"],
    })
    return kwargs

# Tests' own code (cc_test, and testonly libraries and binaries) is compiled at -O1: a test's
# translation unit, mostly GoogleTest's templates, compiles in 12.5 s there against 18 s at -O2
# (the library code they test stays at -O2, and the precompiled header, made at -O2, is taken
# at -O1). The rule's copts come after --copt, so the last -O wins.
def _test_code(kwargs, is_test = False):
    if not kwargs.get("srcs") or not (is_test or kwargs.get("testonly")):
        return kwargs
    kwargs = dict(kwargs)
    kwargs["copts"] = kwargs.get("copts", []) + ["-O1"]
    return kwargs

def dtrain_cc_library(**kwargs):
    native.cc_library(**_with_pch(_test_code(kwargs)))

def dtrain_cc_test(**kwargs):
    native.cc_test(**_with_pch(_test_code(kwargs, is_test = True)))

def dtrain_cc_binary(**kwargs):
    native.cc_binary(**_with_pch(_test_code(kwargs)))
