"""The kernels' own error type: a problem with the inputs or the launch configuration, in one sentence."""


class KernelError(ValueError):
  """An unsupported shape, an illegal launch or a bad tuning table (``jetspec_jax.attention`` turns it into
  the project's ``JetSpecError``)."""
