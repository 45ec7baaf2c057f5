#!/usr/bin/env python3
"""Lists every option of Megatron-LM's argument parser, for memsim's table of Megatron
arguments (tools/lib/megatron_arg_table.cc) and its test data.

Run from a Megatron-LM checkout (git archive of the release memsim follows, README.md):

    { echo "# Megatron-LM COMMIT: every option of its argument parser, as"
      echo "# tools/megatron_arguments.py prints it from that commit."
      python3 /path/to/memsim/tools/megatron_arguments.py; } > tools/lib/testdata/megatron_arguments.tsv

It builds the parser exactly as pretrain_gpt.py does (add_megatron_arguments: the
hand-written groups and those generated from Megatron-Core's config dataclasses) and
prints, per option string (sorted), the attribute it sets and its arity: `flag` (no value),
`value` (one) or `values` (a list). Options that set the same attribute are spellings of
one argument (--no-x and --disable-x).

Only the parser's definitions are wanted, so PyTorch and the other third-party packages
Megatron imports are replaced by permissive stand-ins (any attribute of one is another,
calling one returns it, a class derived from one derives from a plain base), and so are
Megatron's own training loop and RL modules, which define no arguments. Python 3.11 and
no GPU suffice.
"""
import builtins
import os
import sys
import types

STUBBED_TOP_LEVEL = {
    'torch', 'transformer_engine', 'apex', 'triton', 'flash_attn', 'flash_attn_3', 'einops',
    'nvidia_resiliency_ext', 'modelopt', 'safetensors', 'tensorstore', 'zarr', 'wandb',
    'one_logger_utils', 'nvtx', 'mamba_ssm', 'causal_conv1d', 'deep_ep', 'emerging_optimizers',
    'tqdm', 'pydantic', 'requests', 'transformers', 'sentencepiece', 'tiktoken', 'nltk',
    'regex', 'flask', 'flask_restful', 'msgpack', 'zmq', 'psutil', 'cuda', 'pynvml', 'tensorboard',
    'fla', 'lightning', 'hydra', 'omegaconf', 'multistorageclient', 'boto3', 'wrapt',
    'nvshmem', 'hybrid_ep', 'grouped_gemm', 'opentelemetry', 'torchvision', 'PIL', 'cupy', 'scipy',
    'megatron_fsdp', 'nv_one_logger', 'datasets', 'huggingface_hub', 'tokenizers', 'jinja2',
}


class _StandInBase:
    """What a class derived from a stand-in derives from instead."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__()

    def __init__(self, *args, **kwargs):
        pass


class _StandIn:
    def __init__(self, name):
        self.__name__ = self.__qualname__ = name

    def __getattr__(self, name):
        if name.startswith('__') and name.endswith('__'):
            raise AttributeError(name)
        child = _StandIn(name)
        object.__setattr__(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _StandIn):
            return args[0]
        return self

    def __getitem__(self, key):
        return self

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def __ge__(self, other):
        return True

    __le__ = __gt__ = __lt__ = __ge__
    __hash__ = object.__hash__

    def __mro_entries__(self, bases):
        return (_StandInBase,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith('__') and name.endswith('__'):
            raise AttributeError(name)
        child = _StandIn(name)
        setattr(self, name, child)
        return child


_real_import = builtins.__import__


def _module(name):
    if not isinstance(sys.modules.get(name), types.ModuleType):
        module = _StandInModule(name)
        module.__path__ = []
        module.__version__ = '99.0'  # newer than any version check asks
        sys.modules[name] = module
        parent, _, leaf = name.rpartition('.')
        if parent:
            setattr(_module(parent), leaf, module)
    return sys.modules[name]


# Megatron's own modules that define no arguments but import much (the training loop, RL).
STUBBED_MEGATRON = ('megatron.training.training', 'megatron.rl')


def _stubbed(name):
    return name.split('.')[0] in STUBBED_TOP_LEVEL or any(
        name == m or name.startswith(m + '.') for m in STUBBED_MEGATRON)


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and _stubbed(name):
        module = _module(name)
        for attr in fromlist or ():
            if attr != '*':
                getattr(module, attr)
        return module if fromlist else _module(name.split('.')[0])
    try:
        return _real_import(name, globals, locals, fromlist, level)
    except ImportError:
        # A package older than Megatron needs (Debian's numpy lacks numpy.dtypes).
        if level != 0 or name.split('.')[0] == 'megatron' or name in sys.stdlib_module_names:
            raise
        module = _module(name)
        return module if fromlist else sys.modules[name.split('.')[0]]


builtins.__import__ = _import
import typing  # noqa: E402

if not hasattr(typing, 'override'):  # Python 3.12's; Megatron imports it
    typing.override = lambda function: function
sys.argv = ['megatron_arguments']
sys.path.insert(0, os.getcwd())
import argparse  # noqa: E402

from megatron.training.arguments import add_megatron_arguments  # noqa: E402

parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
rows = []
for action in parser._actions:
    if action.nargs == 0:
        arity = 'flag'
    elif action.nargs in (None, 1, '?'):
        arity = 'value'
    else:
        arity = 'values'
    rows += [f'{option}\t{action.dest}\t{arity}' for option in action.option_strings
             if option not in ('-h', '--help')]
print('# option\tattribute\tarity')
print('\n'.join(sorted(rows)))
