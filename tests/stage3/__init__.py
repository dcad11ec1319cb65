"""Tests of zeroshard/stage3/."""
