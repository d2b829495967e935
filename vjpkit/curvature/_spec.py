"""``vk.curvature.stats``: the capture spec that brings its own program.

Contract. ``stats(layers, which, mc_samples, max_factor_dim=)`` checks its arguments and
returns a ``StatsSpec`` whose ``program`` is the curvature transform (``_transform``): given it
in ``capture=``, ``vk.grad`` / ``vk.value_and_grad`` call that program instead of their own.
Nothing is registered at import.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import ConfigError
from .._names import check_glob
from ._stats import MAX_FACTOR_DIM, STATISTICS, StatsSpec
from ._transform import transform


def stats(
    layers: str | Sequence[str] = "*",
    which: str | Sequence[str] = ("kflr",),
    mc_samples: int = 1,
    *,
    max_factor_dim: int = MAX_FACTOR_DIM,
) -> StatsSpec:
    """Chooses layer calls and the curvature statistics to compute for them, in the graph.

    Args:
        layers: a glob or globs over layer paths (layers without parameters are skipped).
        which: any of ``kflr`` (exact GGN K-FAC factors), ``kfac`` (Monte-Carlo Fisher
            factors), ``kfac_empirical`` (empirical Fisher factors), ``ekfac`` (``kfac``'s factors
            and the rows of each example's Monte-Carlo gradient, for EKFAC), ``diag_ggn``,
            ``diag_ggn_mc``, ``sum_grad_squared``, ``batch_l2``, ``backpack_variance`` (BackPACK's
            ``Variance``, of the per-example gradients ``grad l_n / N``; ``vk.inspect.gradient_stats``'s
            ``variance`` is of ``grad l_n``, ``N^2`` times larger), ``grad_rows`` (a dense
            layer's gradient as rows ``a^T d``, for ``kfac``'s records-form preconditioning).
        mc_samples: Monte-Carlo samples for ``kfac``, ``ekfac`` and ``diag_ggn_mc``; the transformed
            function then takes ``key=``.
        max_factor_dim: a K-FAC factor side (``A``'s ``in [+1]``, ``G``'s ``out``) longer than
            this is computed as its diagonal only, a vector (a 50,257-token head's ``G`` would
            be 10 GB in float32). Default 4096, as distributed Shampoo's blocks.

    The K-FAC fields of a layer with no Kronecker rule (an embedding, a norm's scale and shift,
    a residual bias, any other per-example layer) hold its diagonal block instead:
    ``vk.curvature.Diagonal`` of the same curvature (``docs/curvature.md``'s block table). A
    parameter leaf no layer reads (a temperature, a class token) that a glob matches by its path
    gets an entry of its own (``Layout`` kind ``"leaf"``); its per-example statistics take a
    backward pass of the whole model per example, with a warning.

    Returns:
        A spec for ``capture=``: ``captured[name]`` is a ``vk.curvature.LayerCurvature``.

    Examples:
        >>> spec = vk.curvature.stats("fc*", ["kflr", "diag_ggn"])
        >>> (loss, grads), captured = vk.value_and_grad(loss_fn, capture=spec)(params, x, y)
    """
    globs = (layers,) if isinstance(layers, str) else tuple(layers)
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise ConfigError(f"vk.curvature.stats: layers must be a glob or a list of globs, got {layers!r}.")
    for g in globs:
        check_glob(g, "vk.curvature.stats")
    which = (which,) if isinstance(which, str) else tuple(which)
    if "variance" in which:
        raise ConfigError(
            "vk.curvature.stats: 'variance' is now 'backpack_variance': BackPACK's Variance, "
            "(1/N) sum_n g_n^2 - ((1/N) sum_n g_n)^2 of g_n = grad l_n / N. vk.inspect.gradient_stats's "
            "variance is of grad l_n itself (N^2 times larger); the two names say which is which."
        )
    unknown = [w for w in which if w not in STATISTICS]
    if unknown or not which:
        raise ConfigError(
            f"vk.curvature.stats: unknown statistic(s) {unknown or which!r}; choose from {list(STATISTICS)}."
        )
    if not isinstance(mc_samples, int) or isinstance(mc_samples, bool) or mc_samples < 1:
        raise ConfigError(f"vk.curvature.stats: mc_samples must be an int >= 1, got {mc_samples!r}.")
    if not isinstance(max_factor_dim, int) or isinstance(max_factor_dim, bool) or max_factor_dim < 1:
        raise ConfigError(f"vk.curvature.stats: max_factor_dim must be an int >= 1, got {max_factor_dim!r}.")
    return StatsSpec(globs, tuple(dict.fromkeys(which)), mc_samples, max_factor_dim, transform)
