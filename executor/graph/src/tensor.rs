//! A dense f32 tensor, row-major.

use crate::error::TensorError;

/// A dense, row-major f32 tensor.
///
/// The shape and data are checked against each other at construction; a
/// tensor can never hold a data vector of the wrong length.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f32>,
}

/// The number of elements of `shape`, or an error if it overflows.
pub(crate) fn numel(shape: &[usize]) -> Result<usize, TensorError> {
    shape.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d)
            .ok_or_else(|| TensorError::ShapeOverflow(shape.to_vec()))
    })
}

impl Tensor {
    /// Builds a tensor; `data.len()` must equal the product of `shape`.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, TensorError> {
        let expected = numel(&shape)?;
        if expected != data.len() {
            return Err(TensorError::LenMismatch {
                shape,
                expected,
                got: data.len(),
            });
        }
        Ok(Self { shape, data })
    }

    /// A tensor of zeros.
    pub fn zeros(shape: Vec<usize>) -> Result<Self, TensorError> {
        let n = numel(&shape)?;
        Ok(Self {
            shape,
            data: vec![0.0; n],
        })
    }

    /// A one-element tensor of shape `[1]`.
    pub fn scalar(value: f32) -> Self {
        Self {
            shape: vec![1],
            data: vec![value],
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The elements, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The elements, mutably (the shape cannot change).
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// Takes the elements out.
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    /// Takes shape and elements out.
    pub fn into_parts(self) -> (Vec<usize>, Vec<f32>) {
        (self.shape, self.data)
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// `(rows, cols)` if the tensor is a matrix.
    pub fn as_matrix(&self) -> Option<(usize, usize)> {
        match self.shape[..] {
            [r, c] => Some((r, c)),
            _ => None,
        }
    }

    /// Crate-internal constructor for kernels whose output length is right by
    /// construction.
    pub(crate) fn from_parts(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(numel(&shape).ok(), Some(data.len()));
        Self { shape, data }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_constructor() {
        assert!(Tensor::new(vec![2, 3], vec![0.0; 6]).is_ok());
        assert!(matches!(
            Tensor::new(vec![2, 3], vec![0.0; 5]),
            Err(TensorError::LenMismatch {
                expected: 6,
                got: 5,
                ..
            })
        ));
        assert!(matches!(
            Tensor::zeros(vec![usize::MAX, 2]),
            Err(TensorError::ShapeOverflow(_))
        ));
        let t = Tensor::new(vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        assert_eq!(t.as_matrix(), Some((2, 2)));
        assert_eq!(Tensor::scalar(1.0).as_matrix(), None);
    }
}
