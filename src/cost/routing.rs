//! Where a routed token's experts live: how many distinct ranks and nodes
//! of the expert-parallel group one token is sent to.
//!
//! An all-to-all dispatcher sends a token once per expert it is routed to.
//! DeepEP (Megatron-LM's `flex` dispatcher) sends it once per destination
//! node over the network and once per destination rank over NVLink, so its
//! traffic follows these counts instead of top-k. Group-limited routing
//! (DeepSeek-V3's node-limited routing) keeps a token's experts within a
//! few groups, which is what makes the node count small.
//!
//! Routing is taken as uniform (a balanced router, the premise of
//! `moe_load_imbalance`): the token's k experts are k distinct experts
//! drawn alike from those it may use, and each chosen group receives at
//! least one of them (groups are chosen by their best experts' scores).

use crate::model::MoeSpec;

/// Expected distinct units (ranks or nodes) a token's experts fall on,
/// with the experts split evenly and in order over `units` units.
pub fn units_hit(moe: &MoeSpec, units: u64) -> f64 {
    if units <= 1 {
        return units as f64;
    }
    let held = moe.experts as f64 / units as f64;
    units as f64 * (1.0 - missed(moe, held))
}

/// The probability that a unit holding `held` consecutive experts receives
/// none of a token's experts.
fn missed(moe: &MoeSpec, held: f64) -> f64 {
    let experts = moe.experts as f64;
    if moe.router_groups == 0 {
        return none_drawn(experts, held, moe.topk);
    }
    let groups = moe.router_groups as f64;
    let chosen = moe.router_group_topk as f64;
    let group = experts / groups;
    if held >= group {
        // The unit holds whole groups: it is missed when none of them is
        // among the token's chosen groups.
        none_drawn(groups, held / group, moe.router_group_topk)
    } else {
        // Inside one group: missed unless that group is chosen and one of
        // the token's experts, drawn from the chosen groups', is the unit's.
        1.0 - chosen / groups * (1.0 - none_drawn(chosen * group, held, moe.topk))
    }
}

/// Drawing `k` of `n` without replacement: the probability that none of the
/// `marked` ones is drawn.
fn none_drawn(n: f64, marked: f64, k: u64) -> f64 {
    (0..k)
        .map(|j| ((n - marked - j as f64) / (n - j as f64)).clamp(0.0, 1.0))
        .product()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(experts: u64, topk: u64, groups: u64, chosen: u64) -> MoeSpec {
        MoeSpec {
            topk,
            router_groups: groups,
            router_group_topk: chosen,
            ..MoeSpec::megatron_defaults(experts, 2048)
        }
    }

    #[test]
    fn a_token_reaches_between_one_and_top_k_units() {
        for (experts, topk) in [(8, 2), (64, 6), (128, 8), (256, 8)] {
            let m = moe(experts, topk, 0, 0);
            for units in [2, 4, 8, 16, 32, 64] {
                if units > experts {
                    continue;
                }
                let hit = units_hit(&m, units);
                assert!(hit >= 1.0 - 1e-9 && hit <= topk.min(units) as f64 + 1e-9);
            }
            // One expert per unit: every expert a different unit.
            assert!((units_hit(&m, experts) - topk as f64).abs() < 1e-9);
        }
    }

    #[test]
    fn two_experts_of_eight_fall_on_the_expected_ranks() {
        // 8 experts on 4 ranks, top-2: a rank is missed with probability
        // C(6,2)/C(8,2) = 15/28, so 4 x 13/28 ranks are reached.
        let hit = units_hit(&moe(8, 2, 0, 0), 4);
        assert!((hit - 4.0 * 13.0 / 28.0).abs() < 1e-12, "{hit}");
    }

    #[test]
    fn node_limited_routing_reaches_at_most_its_groups() {
        // DeepSeek-V3: 256 experts in 8 groups, 4 chosen, top-8. On 8
        // nodes (a group per node) a token reaches exactly 4 nodes, where
        // unlimited routing of 8 experts reaches about 5.
        let limited = moe(256, 8, 8, 4);
        assert!((units_hit(&limited, 8) - 4.0).abs() < 1e-9);
        let free = moe(256, 8, 0, 0);
        assert!(units_hit(&free, 8) > 4.8);
        // Finer units inside the groups: more ranks than nodes, fewer than
        // unlimited routing reaches, never more than top-k.
        let ranks = units_hit(&limited, 64);
        assert!(ranks > 4.0 && ranks <= units_hit(&free, 64) + 1e-9 && ranks <= 8.0);
    }
}
