"""Config files (`--config=configs/model.py:<preset>`), importable as a
package (`from configs import model`) once kvjax is installed."""
