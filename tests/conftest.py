import jax

# Two CPU devices, so tests can use one as the "accelerator" and the other as the host and every
# transfer the engine makes is a real cross-device put. Must run before the backend starts.
jax.config.update("jax_num_cpu_devices", 2)
