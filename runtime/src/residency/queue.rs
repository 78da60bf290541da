//! The order of transfers on the copy link: demand loads (an adapter a running or admitted
//! request needs now) before prefetches (an adapter of a request still waiting), decided per
//! layer. A pure state machine, so the copy engine's thread only sleeps and lands layers.
//!
//! One FIFO let a demand load queue behind a burst of prefetches: on a slow link each one
//! costs a rank-128 adapter's whole transfer. Here a prefetch is interrupted at the next layer
//! boundary when a demand load arrives, and resumes (from the layer it reached) once no demand
//! load is left, so prefetches still complete and still count.
use std::collections::VecDeque;

/// Why an adapter crosses the link.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum LoadPriority {
    /// A running or admitted request computes with it now.
    Demand,
    /// A waiting request will need it; it yields to every demand load.
    Prefetch,
}

/// Transfers queued on one link and the one in flight (a layer at a time).
#[derive(Debug)]
pub struct LinkQueue<T> {
    demand: VecDeque<T>,
    prefetch: VecDeque<T>,
    /// The transfer whose next layer is crossing now, and its class (a promotion while it is
    /// in flight changes the class here).
    current: Option<(T, LoadPriority)>,
}

impl<T> Default for LinkQueue<T> {
    fn default() -> Self {
        Self {
            demand: VecDeque::new(),
            prefetch: VecDeque::new(),
            current: None,
        }
    }
}

impl<T> LinkQueue<T> {
    /// Queues a transfer behind those of its class.
    pub fn push(&mut self, item: T, p: LoadPriority) {
        match p {
            LoadPriority::Demand => self.demand.push_back(item),
            LoadPriority::Prefetch => self.prefetch.push_back(item),
        }
    }

    /// Makes the prefetch `is` selects a demand load: queued, it moves behind the demand loads
    /// already queued; in flight, it keeps the link (it is partly across already, and needed
    /// now). False if no prefetch matches.
    pub fn promote(&mut self, is: impl Fn(&T) -> bool) -> bool {
        if let Some((t, p)) = &mut self.current {
            if *p == LoadPriority::Prefetch && is(t) {
                *p = LoadPriority::Demand;
                return true;
            }
        }
        match self.prefetch.iter().position(is) {
            Some(i) => {
                let t = self.prefetch.remove(i).expect("position is in range");
                self.demand.push_back(t);
                true
            }
            None => false,
        }
    }

    /// Starts the next layer: the oldest demand load, else the oldest prefetch. The caller
    /// moves one layer of it, then calls [`LinkQueue::finish_layer`].
    pub fn start(&mut self) -> Option<(&T, LoadPriority)> {
        if self.current.is_none() {
            self.current = match self.demand.pop_front() {
                Some(t) => Some((t, LoadPriority::Demand)),
                None => self
                    .prefetch
                    .pop_front()
                    .map(|t| (t, LoadPriority::Prefetch)),
            };
        }
        self.current.as_ref().map(|(t, p)| (t, *p))
    }

    /// The layer in flight crossed. `done`: that was the transfer's last layer, and it is
    /// returned. Otherwise it goes back to the front of its class, so the next
    /// [`LinkQueue::start`] continues it unless a demand load now comes first.
    pub fn finish_layer(&mut self, done: bool) -> Option<T> {
        let (t, p) = self.current.take()?;
        if done {
            return Some(t);
        }
        match p {
            LoadPriority::Demand => self.demand.push_front(t),
            LoadPriority::Prefetch => self.prefetch.push_front(t),
        }
        None
    }

    /// Drops the queued transfers (not the one in flight) that `gone` selects, e.g. adapters
    /// evicted before they landed; returns them. Allocates nothing when none is dropped (the
    /// copy thread asks before every layer).
    pub fn remove_where(&mut self, mut gone: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        for q in [&mut self.demand, &mut self.prefetch] {
            let mut i = 0;
            while i < q.len() {
                if gone(&q[i]) {
                    out.extend(q.remove(i));
                } else {
                    i += 1;
                }
            }
        }
        out
    }

    /// Queued and in-flight transfers of class `p`.
    pub fn iter(&self, p: LoadPriority) -> impl Iterator<Item = &T> {
        let q = match p {
            LoadPriority::Demand => &self.demand,
            LoadPriority::Prefetch => &self.prefetch,
        };
        self.current
            .iter()
            .filter(move |(_, c)| *c == p)
            .map(|(t, _)| t)
            .chain(q.iter())
    }

    /// The transfer whose layer is crossing now, if any.
    pub fn in_flight(&self) -> Option<(&T, LoadPriority)> {
        self.current.as_ref().map(|(t, p)| (t, *p))
    }

    pub fn is_empty(&self) -> bool {
        self.current.is_none() && self.demand.is_empty() && self.prefetch.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One action on the link: queue a transfer of `layers` layers, promote the `k`-th queued
    /// prefetch, or move one layer.
    #[derive(Clone, Debug)]
    enum Op {
        Push { layers: usize, demand: bool },
        Promote(usize),
        Layer,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..5, any::<bool>()).prop_map(|(layers, demand)| Op::Push { layers, demand }),
            (0usize..8).prop_map(Op::Promote),
            Just(Op::Layer),
            Just(Op::Layer),
        ]
    }

    /// A transfer: layers in all, layers moved.
    #[derive(Debug)]
    struct Xfer {
        layers: usize,
        moved: usize,
    }

    struct Sim {
        q: LinkQueue<usize>,
        xfers: Vec<Xfer>,
        /// Ids in the order they became demand loads (pushed as one, or promoted).
        demand_order: Vec<usize>,
        finished: Vec<usize>,
    }

    impl Sim {
        fn layer(&mut self) -> Result<(), TestCaseError> {
            let demand_waiting = self.q.iter(LoadPriority::Demand).count();
            let Some((&id, p)) = self.q.start() else {
                return Ok(());
            };
            // Never a prefetch's layer while a demand load is queued or in flight.
            prop_assert!(
                p == LoadPriority::Demand || demand_waiting == 0,
                "prefetch {id} moved a layer while {demand_waiting} demand loads waited"
            );
            let x = &mut self.xfers[id];
            prop_assert!(
                x.moved < x.layers,
                "transfer {id} moved past its last layer"
            );
            x.moved += 1;
            let done = x.moved == x.layers;
            let out = self.q.finish_layer(done);
            prop_assert_eq!(out, done.then_some(id));
            if done {
                self.finished.push(id);
            }
            Ok(())
        }
    }

    proptest! {
        /// Demand loads never wait behind a prefetch (queued before or after them) beyond the
        /// layer in flight, finish in the order they became demand loads, and every transfer, prefetches included,
        /// completes with each layer moved once.
        #[test]
        fn demand_first_and_everything_completes(ops in proptest::collection::vec(op(), 0..120)) {
            let mut s = Sim { q: LinkQueue::default(), xfers: Vec::new(), demand_order: Vec::new(), finished: Vec::new() };
            for o in ops {
                match o {
                    Op::Push { layers, demand } => {
                        let id = s.xfers.len();
                        s.xfers.push(Xfer { layers, moved: 0 });
                        let p = if demand { LoadPriority::Demand } else { LoadPriority::Prefetch };
                        s.q.push(id, p);
                        if demand {
                            s.demand_order.push(id);
                        }
                    }
                    Op::Promote(k) => {
                        let pick = s.q.iter(LoadPriority::Prefetch).nth(k).copied();
                        if let Some(id) = pick {
                            let in_flight = s.q.current.as_ref().is_some_and(|(t, _)| *t == id);
                            prop_assert!(s.q.promote(|&t| t == id));
                            // One in flight keeps the link (it is partly across already), so
                            // it may pass demand loads queued before its promotion.
                            if !in_flight {
                                s.demand_order.push(id);
                            }
                        } else {
                            prop_assert!(!s.q.promote(|&t| t == usize::MAX));
                        }
                    }
                    Op::Layer => s.layer()?,
                }
            }
            // Drain: everything queued completes.
            let total: usize = s.xfers.iter().map(|x| x.layers).sum();
            for _ in 0..=total {
                s.layer()?;
            }
            prop_assert!(s.q.is_empty());
            prop_assert!(s.xfers.iter().all(|x| x.moved == x.layers), "{:?}", s.xfers);
            prop_assert_eq!(s.finished.len(), s.xfers.len());
            // Demand loads finish in the order they became demand loads (those promoted in
            // flight aside).
            let order: Vec<usize> = s.finished.iter().copied().filter(|id| s.demand_order.contains(id)).collect();
            prop_assert_eq!(order, s.demand_order);
        }
    }

    #[test]
    fn a_prefetch_in_flight_yields_at_the_next_layer_and_resumes() {
        let mut q = LinkQueue::default();
        q.push("p", LoadPriority::Prefetch);
        assert_eq!(q.start(), Some((&"p", LoadPriority::Prefetch)));
        q.push("d", LoadPriority::Demand);
        assert_eq!(q.finish_layer(false), None);
        assert_eq!(q.start(), Some((&"d", LoadPriority::Demand)));
        assert_eq!(q.finish_layer(true), Some("d"));
        assert_eq!(q.start(), Some((&"p", LoadPriority::Prefetch)));
        // Promoted in flight: it keeps the link against a later demand load.
        assert!(q.promote(|t| *t == "p"));
        q.push("d2", LoadPriority::Demand);
        assert_eq!(q.finish_layer(false), None);
        assert_eq!(q.start(), Some((&"p", LoadPriority::Demand)));
        assert_eq!(q.finish_layer(true), Some("p"));
        assert_eq!(q.remove_where(|t| *t == "d2"), vec!["d2"]);
        assert!(q.is_empty());
    }
}
