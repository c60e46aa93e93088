"""The dispatch of the configured policy (`RouterConfig.policy`), built once per router."""

from __future__ import annotations

from services.policy.ampd import SESSION_POLICIES
from services.policy.colocated import COLOCATED_POLICIES
from services.router.auto_dispatch import AUTO, build_auto_dispatch
from services.router.config import RouterConfig
from services.router.disaggregated import SchedulerParams
from services.router.dispatch import ColocatedDispatch, Dispatch
from services.router.dualpath_dispatch import DisaggregatedDispatch
from services.router.engines import EngineTable
from services.router.session_dispatch import SessionDispatch, session_params
from shared.bus import Bus


def build_dispatch(config: RouterConfig, engines: EngineTable, bus: Bus, router_id: str) -> Dispatch:
    """The dispatch of the configured policy."""
    if config.policy in COLOCATED_POLICIES:
        dispatch = ColocatedDispatch(engines, bus, router_id, config.task_ack_timeout_s, policy=config.policy)
        if config.move_query:  # move the query: held chunks routed, fetched or recomputed (route_choice.py)
            from services.router.route_choice import HeldRouting, load_profile

            profile = load_profile(config.movequery_profile)
            dispatch.held_routing = HeldRouting(
                engines, mode=config.move_query, profile=profile, fabric=config.movequery_fabric
            )
        return dispatch
    if config.policy == AUTO:  # one cost model over the paths the engines offer (colocated or P/D)
        return build_auto_dispatch(config, engines, bus, router_id)
    if config.policy in SESSION_POLICIES:
        return SessionDispatch(engines, bus, router_id, config.task_ack_timeout_s, session_params(config))
    params = SchedulerParams(
        policy=config.policy,
        alpha_s=config.alpha_s,
        beta_s=config.beta_s,
        z_factor=config.z_factor,
        force_read_side=config.force_read_side,
        prefill_order=config.prefill_order,
        short_first_ratio=config.short_first_ratio,
    )
    return DisaggregatedDispatch(engines, bus, router_id, config.task_ack_timeout_s, params)
