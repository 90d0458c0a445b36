//! Flat parameter buffers for FSDP-style sharding: a layer's tensors flattened into one 1-D buffer, padded to a
//! multiple of the world size and split evenly, so one all-gather rebuilds the layer and one reduce-scatter shards
//! its gradients. [`FlatLayout`] is the bookkeeping, [`FlatShard`] one rank's shard with its gradient.

use crate::{Communicator, ReduceOp};
use anyhow::{bail, Result};
use std::ops::Range;
use tch::{Kind, Tensor};

/// Where each tensor of a group lives in the flat, padded buffer, and which slice each rank owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    shapes: Vec<Vec<i64>>,
    offsets: Vec<usize>,
    total: usize,
    world: usize,
}

/// A piece of one tensor held in a rank's shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPiece {
    /// Index of the tensor in the layout.
    pub tensor: usize,
    /// Element range inside the flattened tensor.
    pub in_tensor: Range<usize>,
    /// Element range inside the shard.
    pub in_shard: Range<usize>,
}

impl FlatLayout {
    /// The layout of tensors with `shapes` split across `world` ranks.
    pub fn new(shapes: Vec<Vec<i64>>, world: usize) -> Self {
        assert!(world > 0, "world size must be positive");
        let mut offsets = Vec::with_capacity(shapes.len());
        let mut total = 0usize;
        for shape in &shapes {
            offsets.push(total);
            total += shape.iter().product::<i64>() as usize;
        }
        Self {
            shapes,
            offsets,
            total,
            world,
        }
    }

    /// The layout of `tensors` (their shapes) across `world` ranks.
    pub fn of(tensors: &[Tensor], world: usize) -> Self {
        Self::new(tensors.iter().map(|t| t.size()).collect(), world)
    }

    /// Elements of all tensors together (without padding).
    pub fn total(&self) -> usize {
        self.total
    }

    /// Length of the flat buffer: `total` rounded up to a multiple of the world size.
    pub fn padded_len(&self) -> usize {
        self.total.div_ceil(self.world) * self.world
    }

    /// Elements per rank.
    pub fn shard_len(&self) -> usize {
        self.padded_len() / self.world
    }

    /// Number of ranks the buffer is split across.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The tensors' shapes, in order.
    pub fn shapes(&self) -> &[Vec<i64>] {
        &self.shapes
    }

    /// Element range of `rank`'s shard in the flat buffer.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        let n = self.shard_len();
        rank * n..(rank + 1) * n
    }

    /// Flattens `tensors` (shapes must match the layout) into one new 1-D tensor of `padded_len`, zero padded, of
    /// `kind` on the first tensor's device.
    pub fn flatten(&self, tensors: &[Tensor], kind: Kind) -> Result<Tensor> {
        if tensors.len() != self.shapes.len() {
            bail!(
                "flatten: {} tensors given, the layout has {}",
                tensors.len(),
                self.shapes.len()
            );
        }
        let device = tensors
            .first()
            .map(|t| t.device())
            .unwrap_or(tch::Device::Cpu);
        let flat = Tensor::zeros([self.padded_len() as i64], (kind, device));
        for (i, (t, shape)) in tensors.iter().zip(&self.shapes).enumerate() {
            if &t.size() != shape {
                bail!(
                    "flatten: tensor {i} has shape {:?}, the layout expects {shape:?}",
                    t.size()
                );
            }
            let n = shape.iter().product::<i64>();
            flat.narrow(0, self.offsets[i] as i64, n)
                .copy_(&t.reshape([n]));
        }
        Ok(flat)
    }

    /// Views of each tensor inside a full flat buffer (no copy: writes through them change `flat`).
    pub fn views(&self, flat: &Tensor) -> Result<Vec<Tensor>> {
        if flat.size() != [self.padded_len() as i64] {
            bail!(
                "views: flat buffer has shape {:?}, expected [{}]",
                flat.size(),
                self.padded_len()
            );
        }
        Ok(self
            .shapes
            .iter()
            .zip(&self.offsets)
            .map(|(shape, &off)| {
                flat.narrow(0, off as i64, shape.iter().product())
                    .view(shape.as_slice())
            })
            .collect())
    }

    /// A view of `rank`'s shard inside a full flat buffer.
    pub fn shard_of(&self, flat: &Tensor, rank: usize) -> Tensor {
        let r = self.shard_range(rank);
        flat.narrow(0, r.start as i64, r.len() as i64)
    }

    /// Which pieces of which tensors `rank`'s shard holds (padding excluded), in shard order.
    pub fn shard_pieces(&self, rank: usize) -> Vec<ShardPiece> {
        let shard = self.shard_range(rank);
        let mut pieces = Vec::new();
        for (i, shape) in self.shapes.iter().enumerate() {
            let start = self.offsets[i];
            let end = start + shape.iter().product::<i64>() as usize;
            let (a, b) = (start.max(shard.start), end.min(shard.end));
            if a < b {
                pieces.push(ShardPiece {
                    tensor: i,
                    in_tensor: a - start..b - start,
                    in_shard: a - shard.start..b - shard.start,
                });
            }
        }
        pieces
    }
}

/// One rank's shard of a flat parameter group, with its gradient shard.
pub struct FlatShard {
    layout: FlatLayout,
    rank: usize,
    /// This rank's parameters (1-D, `shard_len` elements).
    pub params: Tensor,
    /// This rank's accumulated gradient (same shape as `params`), once [`FlatShard::reduce_scatter_grads`] ran.
    pub grad: Option<Tensor>,
}

impl FlatShard {
    /// Cuts `rank`'s shard (stored as `kind`) out of the full tensors every rank holds, e.g. right after init.
    pub fn from_full(full: &[Tensor], rank: usize, world: usize, kind: Kind) -> Result<Self> {
        let layout = FlatLayout::of(full, world);
        let flat = layout.flatten(full, kind)?;
        let params = layout.shard_of(&flat, rank).copy();
        Ok(Self {
            layout,
            rank,
            params,
            grad: None,
        })
    }

    /// The layout this shard belongs to.
    pub fn layout(&self) -> &FlatLayout {
        &self.layout
    }

    /// The rank owning this shard.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// All-gathers the full flat buffer (in `kind`, e.g. bf16 for compute) and returns it with views of each tensor.
    pub fn gather(&self, comm: &dyn Communicator, kind: Kind) -> Result<(Tensor, Vec<Tensor>)> {
        self.check_group(comm)?;
        let mut flat = Tensor::empty(
            [self.layout.padded_len() as i64],
            (kind, self.params.device()),
        );
        comm.all_gather(&mut flat, &self.params.to_kind(kind).contiguous())?;
        let views = self.layout.views(&flat)?;
        Ok((flat, views))
    }

    /// Flattens this rank's full gradients (one per tensor, layout shapes), reduce-scatters them with `op` (in the
    /// gradients' kind), and adds the result (as the shard's kind) to `grad`.
    pub fn reduce_scatter_grads(
        &mut self,
        comm: &dyn Communicator,
        grads: &[Tensor],
        op: ReduceOp,
    ) -> Result<()> {
        self.check_group(comm)?;
        let kind = grads
            .first()
            .map(|g| g.kind())
            .unwrap_or(self.params.kind());
        let flat = self.layout.flatten(grads, kind)?;
        let shard = comm
            .reduce_scatter_flat(&flat, op)?
            .to_kind(self.params.kind());
        self.grad = Some(match self.grad.take() {
            Some(g) => g + shard,
            None => shard,
        });
        Ok(())
    }

    fn check_group(&self, comm: &dyn Communicator) -> Result<()> {
        if comm.world_size() != self.layout.world_size() || comm.rank() != self.rank {
            bail!(
                "flat shard of rank {} of {} used with a communicator of rank {} of {}",
                self.rank,
                self.layout.world_size(),
                comm.rank(),
                comm.world_size()
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_pads_to_the_world_size_and_maps_pieces() {
        let layout = FlatLayout::new(vec![vec![2, 3], vec![5]], 4);
        assert_eq!(
            (layout.total(), layout.padded_len(), layout.shard_len()),
            (11, 12, 3)
        );
        assert_eq!(layout.shard_range(3), 9..12);
        assert_eq!(
            layout.shard_pieces(1),
            vec![ShardPiece {
                tensor: 0,
                in_tensor: 3..6,
                in_shard: 0..3
            },]
        );
        assert_eq!(
            layout.shard_pieces(3),
            vec![ShardPiece {
                tensor: 1,
                in_tensor: 3..5,
                in_shard: 0..2
            }]
        );
    }

    #[test]
    fn flatten_then_views_round_trips_and_views_alias_the_buffer() {
        let a = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3]);
        let b = Tensor::from_slice(&[10f32, 11., 12., 13., 14.]);
        let layout = FlatLayout::of(&[a.shallow_clone(), b.shallow_clone()], 3);
        let flat = layout
            .flatten(&[a.shallow_clone(), b.shallow_clone()], Kind::Float)
            .unwrap();
        assert_eq!(flat.size(), [12]);
        assert_eq!(f32::try_from(flat.get(11)).unwrap(), 0.0);
        let mut views = layout.views(&flat).unwrap();
        assert!(views[0].equal(&a) && views[1].equal(&b));
        let _ = views[1].fill_(1.0);
        assert_eq!(f32::try_from(flat.get(6)).unwrap(), 1.0);
        assert!(layout
            .flatten(&[b.shallow_clone(), a.shallow_clone()], Kind::Float)
            .is_err());
    }
}
