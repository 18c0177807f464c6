"""Errors the adapter raises. Each names the problem so a user can act on it."""


class MoEOverlayError(Exception):
    """Base of every error the overlay raises on purpose."""


class SpecError(MoEOverlayError, ValueError):
    """A layer description that cannot describe a real MoE layer."""


class MoEInputError(MoEOverlayError, ValueError):
    """Tensors handed to the adapter do not match the layer they are for."""


class LayoutMismatchError(MoEOverlayError, RuntimeError):
    """A kernel was asked to run on weights in a layout it was not prepared for."""


class BackendUnavailableError(MoEOverlayError, RuntimeError):
    """No backend (or not the one asked for, in strict mode) can run this layer."""
