//! [`BatchSource`]: one interface over the file reader and the generator, so
//! a trainer can take either (`--train synthetic` or `--train PATH`).

use std::io::{BufRead, Seek};

use crate::batch::Batch;
use crate::criteo::{CriteoReader, DataError};
use crate::synthetic::Synthetic;

/// A source of training examples that is read in epochs.
pub trait BatchSource: Send {
    /// Clear `batch` and fill it with up to `max` examples; 0 means the end
    /// of the epoch.
    fn read_batch(&mut self, max: usize, batch: &mut Batch) -> Result<usize, DataError>;

    /// Start the next epoch from the beginning.
    fn restart(&mut self) -> Result<(), DataError>;
}

impl BatchSource for Synthetic {
    fn read_batch(&mut self, max: usize, batch: &mut Batch) -> Result<usize, DataError> {
        Ok(self.next_batch(max, batch))
    }

    fn restart(&mut self) -> Result<(), DataError> {
        self.rewind();
        Ok(())
    }
}

impl<R: BufRead + Seek + Send> BatchSource for CriteoReader<R> {
    fn read_batch(&mut self, max: usize, batch: &mut Batch) -> Result<usize, DataError> {
        self.next_batch(max, batch)
    }

    fn restart(&mut self) -> Result<(), DataError> {
        self.rewind()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::criteo::ReaderOptions;
    use crate::synthetic::SyntheticSpec;

    fn epoch(source: &mut dyn BatchSource) -> Batch {
        let mut all = Batch::default();
        let mut b = Batch::default();
        while source.read_batch(64, &mut b).unwrap() > 0 {
            all.extend_from(&b);
        }
        all
    }

    #[test]
    fn file_and_generator_agree_over_epochs() {
        let spec = SyntheticSpec {
            examples_per_epoch: 300,
            ..Default::default()
        };
        let generator = Synthetic::train(spec)
            .unwrap()
            .split(crate::Deal::new(1, 2, 10).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("share.tsv");
        assert_eq!(generator.write_criteo(&path).unwrap(), 150);
        let reader = CriteoReader::open(&path, ReaderOptions::default()).unwrap();
        let mut sources: Vec<Box<dyn BatchSource>> = vec![Box::new(generator), Box::new(reader)];
        let first: Vec<Batch> = sources.iter_mut().map(|s| epoch(s.as_mut())).collect();
        assert_eq!(first[0].len, 150);
        assert_eq!(first[0], first[1]);
        for s in &mut sources {
            s.restart().unwrap();
            assert_eq!(epoch(s.as_mut()), first[0]);
        }
    }
}
