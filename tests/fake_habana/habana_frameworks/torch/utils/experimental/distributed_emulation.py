"""Stand-in for ``utils/experimental/distributed_emulation.py`` (imported by ``hccl``):
emulation is off."""


def is_distributed_emulation_enabled():
    return False


def distributed_emulation_apply_if_enabled():
    pass
