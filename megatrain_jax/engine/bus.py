"""How a unit's bus copy (its weights in the compute dtype, ready to cross to the device) is kept:
one policy per unit, chosen once by `choose` (HostState's `buses`).

    ParamsBus  the bus copy IS the fp32 master weights: state and compute share a device, fp32
               compute, the state in RAM
    HostBus    a host buffer that the update rewrites in place: kept as `spare` between its
               release and the update
    PinnedBus  the accelerator's pinned host memory: the update writes a reused host buffer
               (`staging`, one per unit structure) that is then copied over

Each policy: `make(params)` a bus copy of the weights; `release(unit)` after the unit's last use
in a step; `old_for_update(unit)` the buffer the update donates for its new bus copy (None: none);
`after_update(unit, bus)` the new bus copy from the update's compute-dtype output;
`on_skip(unit, old)` the bus copy when a non-finite norm skipped the update; `make_staging(bus,
host_device)` at construction, the update's reused output buffer (PinnedBus's). `is_params`: the
update returns no bus copy (the weights are it); `on_host`: the copy is in host memory, where the
host reads it (the host lookup, engine/lookup.py).
"""

import jax
import jax.numpy as jnp

from megatrain_jax.engine import transfer


class _Policy:
    def make_staging(self, bus, host_device):
        """The update's reused output buffer for units structured as `bus`: only PinnedBus has
        one."""


class ParamsBus(_Policy):
    """The bus copy is the unit's fp32 master weights themselves."""
    is_params, on_host = True, True

    def make(self, params):
        return params

    def release(self, unit):
        unit.bus = None

    def old_for_update(self, unit):
        return None

    def after_update(self, unit, bus):
        return unit.params

    def on_skip(self, unit, old):
        return unit.params


class HostBus(_Policy):
    """A host buffer in the compute dtype, rewritten in place by the update."""
    is_params, on_host = False, True

    def __init__(self, compute_dtype, host_device):
        self.compute_dtype, self.host_device = compute_dtype, host_device
        self.host = jax.sharding.SingleDeviceSharding(host_device)

    def make(self, params):
        if self.compute_dtype == jnp.float32:  # (the disk tier, where the weights leave RAM
            # between updates): a copy, not the weights, which astype and device_put would return
            params = jax.tree.map(lambda p: jnp.array(p, copy=True, device=self.host_device),
                                  params)
        return transfer.refresh(jax.tree.map(lambda p: p.astype(self.compute_dtype), params),
                                self.host)

    def release(self, unit):
        """Kept for the update to write in place (the plan counts bus copies and gradients
        together): freed and allocated again, it would be page-faulted in each step."""
        if unit.bus is not None:
            unit.spare = unit.bus
        unit.bus = None

    def old_for_update(self, unit):
        return unit.bus if unit.bus is not None else unit.spare

    def after_update(self, unit, bus):
        return bus

    def on_skip(self, unit, old):
        return old if old is not None else self.make(unit.params)  # old: still the weights' copy


class PinnedBus(_Policy):
    """In the compute device's pinned host memory, which it reads by DMA with no staging copy.
    The update cannot write there (another device's memory), so it writes into a reused host
    buffer (`staging[key]`, shared by the units of one structure) that is then copied over.

    Were that copy a zero-copy view of the staging buffer (transfer.across_clients' numpy-view
    put, which on two CPU devices aliases), the next unit's update could not overwrite the copy
    through the donated staging buffer: PJRT does not donate a buffer that a numpy view still
    references, and XLA writes a fresh one instead. Checked by forcing that path on two CPU
    devices: every exactness test passed, only test_update_reuses_buffers[staged] failed (fresh
    memory each update): the hazard is speed, not correctness."""
    is_params, on_host = False, False

    def __init__(self, compute_dtype, sharding, staging: dict, key: int):
        self.compute_dtype, self.sharding, self.staging, self.key = (compute_dtype, sharding,
                                                                     staging, key)

    def make(self, params):
        return transfer.refresh(jax.tree.map(lambda p: p.astype(self.compute_dtype), params),
                                self.sharding)

    def make_staging(self, bus, host_device):
        """The staging buffer, made before the first update so that it compiles once per unit
        structure."""
        zeros = lambda p: jnp.zeros(p.shape, self.compute_dtype, device=host_device)
        self.staging[self.key] = jax.tree.map(zeros, bus)

    def release(self, unit):
        """Back to the accelerator's pinned pool, while the update writes the staging buffer."""
        unit.bus = None

    def old_for_update(self, unit):
        return self.staging.pop(self.key, None)

    def after_update(self, unit, bus):
        self.staging[self.key] = bus  # reused by the next unit: this copy is waited for
        return transfer.refresh(bus, self.sharding)

    def on_skip(self, unit, old):
        bus = self.make(unit.params)
        self.staging[self.key] = old
        return bus


def sharding(compute_device, host_device):
    """Where bus copies wait: the compute device's pinned host memory, which it reads by DMA,
    where it has one and is not the host device; otherwise the host device's memory."""
    if compute_device == host_device or transfer.PINNED not in transfer.memory_kinds(
            compute_device):
        return jax.sharding.SingleDeviceSharding(host_device)
    return jax.sharding.SingleDeviceSharding(compute_device, memory_kind=transfer.PINNED)


def choose(compute_dtype, compute_device, host_device, in_ram: bool, staging: dict) -> tuple:
    """(the sharding bus copies live on, the policies of the three unit structures: 0 the first
    stage, 1 the blocks, 2 the last stage, the policy of a bus copy kept in host memory).

    PinnedBus in the compute device's pinned host memory; otherwise a host buffer rewritten in
    place, the weights themselves in fp32 with the state in RAM (not with the disk tier, where
    the weights leave RAM between updates)."""
    host = HostBus(compute_dtype, host_device)
    on_host = ParamsBus() if compute_dtype == jnp.float32 and in_ram else host
    where = sharding(compute_device, host_device)
    if where.memory_kind != transfer.PINNED:
        return where, [on_host] * 3, on_host
    return where, [PinnedBus(compute_dtype, where, staging, key) for key in range(3)], on_host
