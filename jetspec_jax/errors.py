"""User-facing errors: one sentence that names the problem; the CLI prints it and exits non-zero."""


class JetSpecError(Exception):
  """A problem with the user's input (files, configs, shapes, meshes), stated plainly."""
